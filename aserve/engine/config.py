"""Every configuration object of the engine.

Configs are frozen msgspec Structs validated on construction; derived values are properties.
`models/` never sees these: it gets a model name and a dtype only.
"""

from __future__ import annotations

import msgspec

from models.backends import BACKEND_NAMES as ATTENTION_BACKENDS
from scheduler import PolicyKnobs

DTYPES = ("float32", "float16", "bfloat16", "float64")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which weights to run and how."""

    model: str = "opt-125m"  # a preset or packaged model (models.registry), an HF checkpoint
    # directory or a .gguf file
    dtype: str = "float32"  # one of DTYPES
    attention: str = "paged"  # decode attention backend, one of ATTENTION_BACKENDS
    max_position_embeddings: int | None = None  # extend a preset's position table (tokens)
    tokenizer: str | None = None  # a directory with tokenizer files, or "bytes" for the
    # byte-level tokenizer; None: the checkpoint directory's own (a preset: byte-level)
    weights_seed: int = 0  # seed of a preset's random weights (a checkpoint has its own)
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (CUDA, triton backends)
    # run the steps that instances sharing a device submit together as one forward (a CPU
    # engine's prefill and decode steps read the weights once)
    fuse_steps: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype ({self.dtype!r}) must be one of {', '.join(DTYPES)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention ({self.attention!r}) must be one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(
                f"max_position_embeddings ({self.max_position_embeddings}) must be >= 1"
            )


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """KV memory on every location, in blocks of `block_size` tokens (host pool in GB)."""

    block_size: int = 16  # tokens per KV block
    num_decode_blocks: int = 2048  # decode KV capacity per decode instance (blocks)
    num_prefill_blocks: int = 1024  # scratch KV on each prefill instance (blocks)
    num_staging_blocks: int = 1024  # candidate buffers on each prefill device (blocks)
    host_pool_gb: float = 2.0  # host KV pool capacity (GiB)
    # Stores on one device (a CPU-only engine's four; a GPU's scratch and staging) share one
    # KV tensor, and a move between them hands the block table over instead of copying it
    # (transport/blocks.py). False: a tensor per store and a copy per move, as between devices.
    share_kv_memory: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_decode_blocks", "num_prefill_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.num_staging_blocks < 0:
            raise ValueError(f"num_staging_blocks ({self.num_staging_blocks}) must be >= 0")
        if self.host_pool_gb <= 0:
            raise ValueError(f"host_pool_gb ({self.host_pool_gb}) must be > 0")

    @property
    def host_pool_bytes(self) -> int:
        return int(self.host_pool_gb * 2**30)


class SchedulerConfig(PolicyKnobs, frozen=True, kw_only=True):
    """Which policy runs, its budgets, and the policy's knobs. The knobs (`min_requests`,
    `leaf_width`, `starvation_threshold`, `match_slack`, `max_spread`, `drain_floor`) are
    inherited from `scheduler.PolicyKnobs`: their meaning, defaults and validation live
    there, once."""

    policy: str = "aligned"  # aligned | aligned-loose | aligned-noprefetch | fcfs | continuous
    max_prefill_tokens: int = 2048  # token budget of one prefill (or mixed) step
    max_batch_size: int = 256  # most sequences in one decode iteration
    batch_kv_fraction: float = 0.9  # share of decode KV a new batch may take (room to grow)
    max_waiting: int = 4096  # requests waiting for prefill before new ones get 429

    def __post_init__(self) -> None:
        super().__post_init__()  # the knobs
        for name in ("max_prefill_tokens", "max_batch_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if not 0 < self.batch_kv_fraction <= 1:
            raise ValueError(f"batch_kv_fraction ({self.batch_kv_fraction}) must be in (0, 1]")


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The HTTP front end."""

    host: str = "127.0.0.1"  # bind address; loopback unless asked otherwise
    port: int = 8000
    api_key: str | None = None  # bearer token required on every route but /health
    served_model_name: str | None = None  # name in /v1/models; defaults to the model
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback and the bound
    # address (421 otherwise); "*" accepts any
    allowed_origins: tuple[str, ...] = ()  # CORS: origins a browser page may call from;
    # empty: CORS off; "*" any
    header_timeout: float = 10.0  # seconds a connection may take to send a request's head
    body_timeout: float = 30.0  # seconds a request's body may take once its head is in (408)
    keepalive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 512  # open connections; past it a connection gets a 503 and closes
    max_request_prompts: int = 4096  # prompts in one request (400 past it)
    max_request_tokens: int = 1 << 20  # sum over a request's prompts of prompt + max_tokens
    # seconds a stream's write may wait for its client to read; then the stream is aborted
    # and its KV freed
    write_timeout: float = 30.0
    # tokens (prompt + max_tokens, over every sample) one client address may have in flight;
    # past it 429 (a client with nothing in flight is always let in). 0: no fixed budget
    max_client_tokens: int = 0
    # seconds a client address counts as active after its last completion request. While the
    # decode KV cannot hold every client's tokens in flight, a client past an equal share of
    # it among the active clients gets 429 (one with nothing in flight is always let in; a
    # lone client never). 0: no fair share
    fair_share_window: float = 60.0
    # seconds of prefill the prompts waiting for it may need, at the pace of recent prefill
    # steps, before new requests get 429 (the server sheds load it cannot carry). 0: no bound
    max_prefill_backlog: float = 30.0
    health_details: bool = False  # /health names actors and errors to anyone (else: key only)
    chat_template: str | None = None  # a Jinja file or built-in name; None: the checkpoint's

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port ({self.port}) must be in [0, 65535]")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes ({self.max_body_bytes}) must be >= 1024")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout", "write_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be > 0 seconds")
        for name in ("max_connections", "max_request_prompts", "max_request_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.max_client_tokens < 0:
            raise ValueError(f"max_client_tokens ({self.max_client_tokens}) must be >= 0")
        for name in ("fair_share_window", "max_prefill_backlog"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0 seconds")


class _FlatKeywords(msgspec.StructMeta):
    """Lets `EngineConfig(model="opt-125m", dtype="bfloat16", policy="fcfs")` take the flat
    keywords of `EngineConfig.create` (as vLLM's engine arguments are flat)."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        if args or all(k in _TOP_LEVEL or k in _AREAS and isinstance(v, msgspec.Struct)
                       for k, v in kwargs.items()):
            return super().__call__(*args, **kwargs)
        return cls.create(**kwargs)  # type: ignore[attr-defined]


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, metaclass=_FlatKeywords):
    """Everything the engine needs; composed of one config per area.

    Either by area (`EngineConfig(model=ModelConfig(...), cache=CacheConfig(...))`) or by
    flat keywords, vLLM's names included (`EngineConfig(model="opt-125m", dtype="bfloat16",
    policy="fcfs", max_num_seqs=64)`); see `create`.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    prefill_devices: tuple[str, ...] = ("cpu",)  # one prefill instance per entry
    decode_devices: tuple[str, ...] = ("cpu",)  # one decode instance per entry
    seed: int = 0  # seeds the RNG that sampled requests without their own seed draw from
    # lifecycle events and iteration records kept, each (past it the older half is dropped,
    # so a long-running server's memory stays bounded); None keeps the full log
    trace_limit: int | None = 8192
    num_threads: int | None = None  # torch CPU threads for the process; None: torch's default
    # a Ray cluster ("auto", or the head's HOST:PORT) whose nodes run the instances, placed by
    # the resources aserve_prefill and aserve_decode (docs/cluster.md); None: this process
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.trace_limit is not None and self.trace_limit < 2:
            raise ValueError(f"trace_limit ({self.trace_limit}) must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads ({self.num_threads}) must be >= 1 or None")
        if not self.prefill_devices:
            raise ValueError("prefill_devices must name at least one device")
        if not self.decode_devices:
            raise ValueError("decode_devices must name at least one device")
        for dev in (*self.prefill_devices, *self.decode_devices):
            if not (dev == "cpu" or dev == "cuda" or dev.startswith("cuda:")):
                raise ValueError(f"device ({dev!r}) must be 'cpu' or 'cuda[:N]'")
        if self.ray_address is not None and not self.ray_address.strip():
            raise ValueError("ray_address must be 'auto' or HOST:PORT, not empty")

    @classmethod
    def create(cls, **kwargs: object) -> EngineConfig:
        """Builds a config from flat keyword arguments (`model=`, `policy=`, `block_size=`…),
        routing each to its area; vLLM's names (`VLLM_NAMES`, `enforce_eager`) are accepted.
        An area object (`model=ModelConfig(...)`) is the base its flat keywords override.

        Raises:
            ValueError: an unknown name, or a value its config rejects.
        """
        bases: dict[str, msgspec.Struct] = {
            "model": ModelConfig(), "cache": CacheConfig(), "scheduler": SchedulerConfig()}
        areas: dict[str, dict[str, object]] = {area: {} for area in bases}
        top: dict[str, object] = {}
        for key, value in kwargs.items():
            if key in bases and isinstance(value, msgspec.Struct):
                bases[key] = value
                continue
            if key == "enforce_eager":
                key, value = "cuda_graphs", not value
            key = VLLM_NAMES.get(key, key)
            area = _AREA_OF.get(key)
            if area is None:
                raise ValueError(f"unknown engine option {key!r}")
            (areas[area] if area else top)[key] = value
        for key in ("prefill_devices", "decode_devices"):
            if isinstance(top.get(key), str):
                top[key] = (top[key],)
            elif key in top:
                top[key] = tuple(top[key])  # type: ignore[arg-type]
        built = {area: type(base)(**{**msgspec.structs.asdict(base), **areas[area]})
                 for area, base in bases.items()}
        return cls(**built, **top)  # type: ignore[arg-type]


def _fields(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    return struct.__struct_fields__


_AREAS = ("model", "cache", "scheduler")  # EngineConfig's fields that are config objects
_TOP_LEVEL = ("prefill_devices", "decode_devices", "seed", "trace_limit", "num_threads",
              "ray_address")
VLLM_NAMES = {"max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_prefill_tokens",
              "max_model_len": "max_position_embeddings"}  # vLLM's name -> ours, same meaning
_AREA_OF: dict[str, str] = {
    **{f: "model" for f in _fields(ModelConfig)},
    **{f: "cache" for f in _fields(CacheConfig)},
    **{f: "scheduler" for f in _fields(SchedulerConfig)},
    **{f: "" for f in _TOP_LEVEL},
}
