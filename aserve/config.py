"""Every configuration object, and the one place that reads the CLI and the environment.

Configs are frozen msgspec Structs validated on construction; derived values are properties.
`models/` never sees these: it gets a model name and a dtype only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

import msgspec

from models.backends import BACKEND_NAMES as ATTENTION_BACKENDS
from scheduler import PolicyConfig

DTYPES = ("float32", "float16", "bfloat16", "float64")
ENV_PREFIX = "ASERVE_"


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


_KNOBS = PolicyConfig()  # the policy knobs' defaults


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which policy runs, its budgets, and the policy's knobs. The knobs (from
    `min_requests` on) are declared in `scheduler.PolicyConfig`: their meaning, defaults
    and validation live there, once."""

    policy: str = "aligned"  # aligned | aligned-loose | aligned-noprefetch | fcfs | continuous
    max_prefill_tokens: int = 2048  # token budget of one prefill (or mixed) step
    max_batch_size: int = 256  # most sequences in one decode iteration
    batch_kv_fraction: float = 0.9  # share of decode KV a new batch may take (room to grow)
    max_waiting: int = 4096  # requests waiting for prefill before new ones get 503
    min_requests: int = _KNOBS.min_requests
    leaf_width: int = _KNOBS.leaf_width
    starvation_threshold: float | None = _KNOBS.starvation_threshold
    match_slack: float = _KNOBS.match_slack
    max_spread: float | None = _KNOBS.max_spread
    drain_floor: float = _KNOBS.drain_floor

    def __post_init__(self) -> None:
        for name in ("max_prefill_tokens", "max_batch_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if not 0 < self.batch_kv_fraction <= 1:
            raise ValueError(f"batch_kv_fraction ({self.batch_kv_fraction}) must be in (0, 1]")
        PolicyConfig.of(self, max_len=1)  # validates the knobs (the tree range comes later)


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
    health_details: bool = False  # /health names actors and errors to anyone (else: key only)
    chat_template: str | None = None  # a Jinja file or built-in name; None: the checkpoint's

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port ({self.port}) must be in [0, 65535]")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes ({self.max_body_bytes}) must be >= 1024")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be > 0 seconds")
        for name in ("max_connections", "max_request_prompts", "max_request_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")


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
    trace_limit: int = 1_000_000  # lifecycle events / iteration records kept (oldest dropped)
    num_threads: int | None = None  # torch CPU threads for the process; None: torch's default

    def __post_init__(self) -> None:
        if self.trace_limit < 2:
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
_TOP_LEVEL = ("prefill_devices", "decode_devices", "seed", "trace_limit", "num_threads")
VLLM_NAMES = {"max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_prefill_tokens",
              "max_model_len": "max_position_embeddings"}  # vLLM's name -> ours, same meaning
_AREA_OF: dict[str, str] = {
    **{f: "model" for f in _fields(ModelConfig)},
    **{f: "cache" for f in _fields(CacheConfig)},
    **{f: "scheduler" for f in _fields(SchedulerConfig)},
    **{f: "" for f in _TOP_LEVEL},
}


def _env_default(name: str, default: object, env: Mapping[str, str]) -> object:
    value = env.get(ENV_PREFIX + name.upper().replace("-", "_"))
    return default if value is None else value


def add_engine_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Adds the engine options to a CLI parser; each defaults to its ASERVE_* variable.

    Help texts leave the default to the parser's formatter (`HELP_FORMATTER`), which shows it.
    """
    from models.registry import PACKAGED_MODELS, preset_names
    from scheduler import POLICIES

    m, c, s, e = ModelConfig(), CacheConfig(), SchedulerConfig(), EngineConfig()
    d = lambda n, v: _env_default(n, v, env)  # noqa: E731
    add = parser.add_argument
    random_presets = [n for n in preset_names() if n not in PACKAGED_MODELS]
    add("--model", default=d("model", m.model),
        help=f"a trained model installed as a package ({', '.join(PACKAGED_MODELS)}), a "
             f"preset with random weights ({', '.join(random_presets)}), a "
             "checkpoint directory (OPT, Llama, Mistral or Qwen2: config.json, weights, "
             "tokenizer files) or a .gguf file (Llama family)")
    add("--tokenizer", default=d("tokenizer", m.tokenizer),
        help="a directory with tokenizer files (tokenizer.json, or vocab.json + merges.txt), "
             "or 'bytes' for the byte-level tokenizer; None: the model directory's own "
             "(presets: byte-level)")
    add("--dtype", default=d("dtype", m.dtype), choices=DTYPES,
        help="weights and KV cache dtype")
    add("--attention", default=d("attention", m.attention), choices=ATTENTION_BACKENDS,
        help="decode attention backend")
    add("--max-model-len", "--max-position-embeddings", dest="max_position_embeddings",
        type=int, metavar="TOKENS", default=d("max_position_embeddings", m.max_position_embeddings),
        help="context limit in tokens: extends a preset's position table, caps a "
             "checkpoint's; None: the model's own")
    add("--policy", default=d("policy", s.policy), choices=sorted(POLICIES),
        help="batching policy (docs/design.md §4)")
    add("--prefill-device", dest="prefill_devices", action="append", metavar="DEVICE",
        help="a prefill instance's device (cpu, cuda, cuda:N); repeat for several; None: "
             "ASERVE_PREFILL_DEVICES (comma list), else cpu")
    add("--decode-device", dest="decode_devices", action="append", metavar="DEVICE",
        help="a decode instance's device; repeat for several; None: "
             "ASERVE_DECODE_DEVICES (comma list), else cpu")
    add("--block-size", type=int, default=d("block_size", c.block_size),
        help="tokens per KV block")
    add("--num-decode-blocks", type=int, default=d("num_decode_blocks", c.num_decode_blocks),
        help="KV blocks of each decode instance")
    add("--num-prefill-blocks", type=int,
        default=d("num_prefill_blocks", c.num_prefill_blocks),
        help="scratch KV blocks of each prefill instance")
    add("--num-staging-blocks", type=int,
        default=d("num_staging_blocks", c.num_staging_blocks),
        help="candidate-buffer KV blocks on each prefill device")
    add("--host-pool-gb", type=float, default=d("host_pool_gb", c.host_pool_gb),
        help="host KV pool capacity (GiB)")
    add("--share-kv-memory", action=argparse.BooleanOptionalAction,
        default=d("share_kv_memory", c.share_kv_memory),
        help="KV stores on one device share one tensor and move KV by handing block tables "
             "over (no copy)")
    add("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=int, metavar="N",
        default=d("max_batch_size", s.max_batch_size),
        help="most sequences in one decode iteration")
    add("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_prefill_tokens",
        type=int, metavar="TOKENS", default=d("max_prefill_tokens", s.max_prefill_tokens),
        help="token budget of one prefill (or mixed) step")
    add("--min-requests", type=int, default=d("min_requests", s.min_requests),
        help="density-first search: smallest batch that saturates the decode device")
    add("--max-waiting", type=int, default=d("max_waiting", s.max_waiting),
        help="requests waiting for prefill before new ones get HTTP 503")
    add("--max-spread", type=spread_arg, default=d("max_spread", s.max_spread),
        help="aligned-strict: the longest/shortest prefix ratio an admission may leave in "
             "the running batch ('off': the paper's looser rules)")
    add("--seed", type=int, default=d("seed", e.seed),
        help="seeds the RNG that sampled requests without their own seed draw from "
             "(as vLLM's --seed)")
    add("--weights-seed", type=int, default=d("weights_seed", m.weights_seed),
        help="seed of a preset's random weights (a checkpoint has its own)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Keeps descriptions as written and appends "(default: ...)" to every option's help."""


HELP_FORMATTER = HelpFormatter


_ENGINE_ARGS = (
    "model", "tokenizer", "dtype", "attention", "max_position_embeddings", "policy",
    "block_size", "num_decode_blocks", "num_prefill_blocks", "num_staging_blocks",
    "host_pool_gb", "share_kv_memory", "max_batch_size", "max_prefill_tokens", "min_requests",
    "max_waiting", "max_spread", "seed", "weights_seed",
)


def engine_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> EngineConfig:
    """The EngineConfig the parsed CLI arguments describe (types coerced from env strings)."""
    types = {
        **{f: t for f, t in _annotations(ModelConfig).items()},
        **{f: t for f, t in _annotations(CacheConfig).items()},
        **{f: t for f, t in _annotations(SchedulerConfig).items()},
        **{f: t for f, t in _annotations(EngineConfig).items() if f in _TOP_LEVEL},
    }
    kwargs: dict[str, object] = {}
    for name in _ENGINE_ARGS:
        value = getattr(args, name)
        if isinstance(value, str) and types.get(name) in ("int", "float", "int | None",
                                                          "float | None"):
            value = float(value) if types[name].startswith("float") else int(value)
        elif isinstance(value, str) and types.get(name) == "bool":
            value = value.strip().lower() in ("1", "true", "yes", "on")
        kwargs[name] = value
    prefill = args.prefill_devices or _split(env.get(ENV_PREFIX + "PREFILL_DEVICES", "cpu"))
    decode = args.decode_devices or _split(env.get(ENV_PREFIX + "DECODE_DEVICES", "cpu"))
    return EngineConfig.create(prefill_devices=prefill, decode_devices=decode, **kwargs)


def spread_arg(text: str) -> float | None:
    """``--max-spread``: a ratio >= 1, or ``off`` / ``none`` for no bound."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"max spread {text!r} is neither a number nor 'off'") from None


def _annotations(struct: type) -> dict[str, str]:
    return {k: str(v) for k, v in struct.__annotations__.items()}


def _split(value: str) -> Sequence[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def environ() -> Mapping[str, str]:
    """The process environment; the only read of os.environ in the package."""
    return os.environ


SERVER_LIMITS = (  # ServerConfig's numeric limits: (field, help); typed as their default
    ("max_body_bytes", "larger request bodies get HTTP 413"),
    ("header_timeout", "seconds a connection may take to send a request's headers"),
    ("body_timeout", "seconds a request body may take once its headers are in; then 408"),
    ("keepalive_timeout", "seconds an idle keep-alive connection stays open"),
    ("max_connections", "open connections served at once; a connection past it gets 503 and "
                        "is closed"),
    ("max_request_prompts", "prompts one request may carry; more get 400"),
    ("max_request_tokens", "prompt tokens plus max_tokens, summed over one request's prompts; "
                           "more get 400"),
)


def add_server_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Adds the HTTP server options; each defaults to its ASERVE_* variable."""
    s = ServerConfig()
    d = lambda n, v: _env_default(n, v, env)  # noqa: E731
    parser.add_argument("--host", default=d("host", s.host),
                        help="bind address (loopback unless asked otherwise)")
    parser.add_argument("--port", type=int, default=d("port", s.port),
                        help="TCP port (0: any free port)")
    parser.add_argument("--api-key", default=d("api_key", None),
                        help="bearer token required on every route but /health and /ping; "
                             "None: open")
    parser.add_argument("--served-model-name",
                        default=d("served_model_name", None),
                        help="the model's name in /v1/models and requests; None: --model")
    parser.add_argument("--allowed-hosts", type=_split, default=d("allowed_hosts", ""),
                        help="comma-separated Host names accepted besides loopback names and "
                             "the bound address, '*' for any; others get 421")
    parser.add_argument("--allowed-origins", type=_split, default=d("allowed_origins", ""),
                        help="comma-separated origins (scheme://host[:port]) whose pages may "
                             "call the API through CORS, '*' for any; none: CORS off")
    for name, text in SERVER_LIMITS:
        default = getattr(s, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default),
                            default=d(name, default), help=text)
    parser.add_argument("--health-details", action="store_true",
                        default=str(d("health_details", "")).lower() in ("1", "true", "yes"),
                        help="/health names the actors and their last errors to any caller "
                             "(off: only to callers with the API key)")
    from aserve.chat import CHAT_TEMPLATES  # the registry of built-in template names

    parser.add_argument(
        "--chat-template", default=d("chat_template", None),
        metavar="FILE|NAME",
        help="chat template for /v1/chat/completions: a Jinja file, or a built-in name ("
             + ", ".join(CHAT_TEMPLATES) + "); default: the checkpoint's own template "
             "(chat_template.jinja or tokenizer_config.json), else chat is refused with a 400")


def server_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> ServerConfig:
    """The ServerConfig the parsed CLI arguments describe."""
    return ServerConfig(host=args.host, port=int(args.port), api_key=args.api_key or None,
                        served_model_name=args.served_model_name,
                        allowed_hosts=tuple(args.allowed_hosts),
                        allowed_origins=tuple(args.allowed_origins),
                        **{name: getattr(args, name) for name, _ in SERVER_LIMITS},
                        health_details=bool(args.health_details),
                        chat_template=args.chat_template or None)
