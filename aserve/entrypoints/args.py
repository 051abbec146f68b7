"""The command line's options and the ASERVE_* environment: the one place that reads them.

The engine's options are generated from the config fields (`ModelConfig`, `CacheConfig`,
`SchedulerConfig`, `EngineConfig`): each field is an option `--field-name`, with the field's
default and type, its help from `ENGINE_HELP`, and vLLM's name as an alias where it has one.
A field without help is an error when the parser is built, so no knob is left off the CLI.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence

import msgspec

from aserve.engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

ENV_PREFIX = "ASERVE_"

ENGINE_HELP: dict[str, str] = {  # every engine config field's option help (default added)
    # ModelConfig
    "model": "a trained model installed as a package ({packaged}), a preset with random "
             "weights ({presets}), a checkpoint directory (OPT, Llama, Mistral or Qwen2: "
             "config.json, weights, tokenizer files) or a .gguf file (Llama family)",
    "dtype": "weights and KV cache dtype",
    "attention": "decode attention backend",
    "max_position_embeddings": "context limit in tokens: extends a preset's position table, "
                               "caps a checkpoint's; none: the model's own",
    "tokenizer": "a directory with tokenizer files (tokenizer.json, or vocab.json + "
                 "merges.txt), or 'bytes' for the byte-level tokenizer; none: the model "
                 "directory's own (presets: byte-level)",
    "weights_seed": "seed of a preset's random weights (a checkpoint has its own)",
    "cuda_graphs": "replay decode steps as CUDA graphs (CUDA, Triton backends; vLLM's "
                   "--enforce-eager is --no-cuda-graphs)",
    "fuse_steps": "run the steps that a device's prefill and decode instances submit "
                  "together as one forward (--no-fuse-steps: one forward each)",
    # CacheConfig
    "block_size": "tokens per KV block",
    "num_decode_blocks": "KV blocks of each decode instance",
    "num_prefill_blocks": "scratch KV blocks of each prefill instance",
    "num_staging_blocks": "candidate-buffer KV blocks on each prefill device",
    "host_pool_gb": "host KV pool capacity (GiB)",
    "share_kv_memory": "KV stores on one device share one tensor and move KV by handing "
                       "block tables over (no copy)",
    # SchedulerConfig: budgets
    "policy": "batching policy (docs/design.md §4)",
    "max_prefill_tokens": "token budget of one prefill (or mixed) step",
    "max_batch_size": "most sequences in one decode iteration",
    "batch_kv_fraction": "share of decode KV a new batch may take (the rest is room to grow)",
    "max_waiting": "requests waiting for prefill before new ones get HTTP 429",
    # SchedulerConfig: the policy knobs (scheduler.PolicyConfig)
    "min_requests": "density-first search: smallest batch that saturates the decode device",
    "leaf_width": "quad-tree leaf range (tokens)",
    "starvation_threshold": "seconds a request may wait before it is served first ('off': "
                            "no starvation control)",
    "match_slack": "dynamic prefetch: widening of the running batch's length window "
                   "(fraction of length)",
    "max_spread": "aligned-strict: the longest/shortest prefix ratio an admission may leave "
                  "in the running batch ('off': the paper's looser rules)",
    "drain_floor": "aligned, aligned-strict: a batch switch waits for the old batch to drain "
                   "to this share of --max-batch-size",
    # EngineConfig
    "seed": "seeds the RNG that sampled requests without their own seed draw from (as "
            "vLLM's --seed)",
    "trace_limit": "lifecycle events and iteration records kept, each (the older half is "
                   "dropped past it); none keeps the full log",
    "num_threads": "torch CPU threads for the process; none: torch's default",
    "ray_address": "run the instances on the nodes of this Ray cluster ('auto' or the head's "
                   "HOST:PORT; needs the cluster extra, docs/cluster.md); none: in this "
                   "process",
}
ENGINE_ALIASES = {  # vLLM's option name, shown first, for the fields that have one
    "max_position_embeddings": "--max-model-len",
    "max_batch_size": "--max-num-seqs",
    "max_prefill_tokens": "--max-num-batched-tokens",
}
DEVICE_FIELDS = ("prefill_devices", "decode_devices")  # repeated options, not one value


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Keeps descriptions as written and appends "(default: ...)" to every option's help."""


HELP_FORMATTER = HelpFormatter


def optional(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An option's type for a field that may be None: 'none' or 'off' gives None."""
    def parse_optional(text: str) -> object:
        if text.strip().lower() in ("none", "off"):
            return None
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither a {parse.__name__} nor "
                                             "'off'") from None
    parse_optional.__name__ = f"{parse.__name__} or off"
    return parse_optional


spread_arg = optional(float)  # ``--max-spread``: a ratio >= 1, or 'off' for no bound


def engine_fields() -> dict[str, tuple[object, str]]:
    """Every engine config field that is one option: name -> (default, annotation)."""
    fields: dict[str, tuple[object, str]] = {}
    for struct in (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig):
        for info in msgspec.structs.fields(struct):
            if info.name in ("model", "cache", "scheduler") and struct is EngineConfig:
                continue  # the areas themselves
            if info.name not in DEVICE_FIELDS:
                fields[info.name] = (info.default, _annotation(struct, info.name))
    return fields


def _annotation(struct: type, name: str) -> str:
    """The annotation of field `name` as written, inherited fields included."""
    return next(str(klass.__annotations__[name]) for klass in struct.__mro__
                if name in getattr(klass, "__annotations__", {}))


def _type_of(default: object, annotation: str) -> Callable[[str], object] | None:
    base = {"int": int, "float": float, "str": str}.get(annotation.split(" |")[0])
    if base is None:
        return None
    return optional(base) if "None" in annotation else base


def _env_default(name: str, default: object, env: Mapping[str, str]) -> object:
    value = env.get(ENV_PREFIX + name.upper().replace("-", "_"))
    return default if value is None else value


def add_engine_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Adds an option per engine config field (`engine_fields`); each defaults to its
    ASERVE_* variable, else the field's default. Raises KeyError naming a field without
    help."""
    from models.registry import PACKAGED_MODELS, preset_names
    from scheduler import POLICIES

    random_presets = [n for n in preset_names() if n not in PACKAGED_MODELS]

    choices: dict[str, Sequence[str]] = {"dtype": DTYPES, "attention": ATTENTION_BACKENDS,
                                         "policy": sorted(POLICIES)}
    for name, (default, annotation) in engine_fields().items():
        help_text = ENGINE_HELP[name].format(packaged=", ".join(PACKAGED_MODELS),
                                             presets=", ".join(random_presets))
        flags = [*filter(None, [ENGINE_ALIASES.get(name)]), "--" + name.replace("_", "-")]
        kwargs: dict[str, object] = {"dest": name, "help": help_text,
                                     "default": _env_default(name, default, env)}
        if annotation == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _type_of(default, annotation)
            if name in choices:
                kwargs["choices"] = choices[name]
        parser.add_argument(*flags, **kwargs)  # type: ignore[arg-type]
    parser.add_argument("--prefill-device", dest="prefill_devices", action="append",
                        metavar="DEVICE",
                        help="a prefill instance's device (cpu, cuda, cuda:N); repeat for "
                             "several; none: ASERVE_PREFILL_DEVICES (comma list), else cpu")
    parser.add_argument("--decode-device", dest="decode_devices", action="append",
                        metavar="DEVICE",
                        help="a decode instance's device; repeat for several; none: "
                             "ASERVE_DECODE_DEVICES (comma list), else cpu")


def engine_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> EngineConfig:
    """The EngineConfig the parsed CLI arguments describe (env strings of flags coerced)."""
    kwargs: dict[str, object] = {}
    for name, (_, annotation) in engine_fields().items():
        value = getattr(args, name)
        if annotation == "bool" and isinstance(value, str):
            value = value.strip().lower() in ("1", "true", "yes", "on")
        kwargs[name] = value
    prefill = args.prefill_devices or _split(env.get(ENV_PREFIX + "PREFILL_DEVICES", "cpu"))
    decode = args.decode_devices or _split(env.get(ENV_PREFIX + "DECODE_DEVICES", "cpu"))
    return EngineConfig.create(prefill_devices=prefill, decode_devices=decode, **kwargs)


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
    ("write_timeout", "seconds a stream may wait for its client to read; then it is aborted "
                      "and its KV freed"),
    ("max_connections", "open connections served at once; a connection past it gets 503 and "
                        "is closed"),
    ("max_request_prompts", "prompts one request may carry; more get 400"),
    ("max_client_tokens", "tokens (prompt + max_tokens, over every sample) one client address "
                          "may have in flight; past it 429 (one with none in flight is always "
                          "let in); 0: no fixed budget"),
    ("fair_share_window", "seconds a client address counts as active after its last "
                          "completion; while the decode KV cannot hold every client's tokens "
                          "in flight, one past an equal share among active clients gets 429 "
                          "(a lone client never); 0: no fair share"),
    ("max_prefill_backlog", "seconds of prefill the waiting prompts may need (at recent "
                            "steps' pace) before new requests get 429; 0: no bound"),
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
    from aserve.entrypoints.chat import CHAT_TEMPLATES  # the registry of built-in template names

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
