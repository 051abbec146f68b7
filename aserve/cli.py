"""The `aserve` command: `serve`, `generate`, `bench` and `sim`.

Arguments and ASERVE_* variables are parsed in aserve/config.py; this file dispatches.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from aserve.config import (
    ServerConfig,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    environ,
    server_config_from_args,
)
from aserve.core import SamplingParams


def _parser() -> argparse.ArgumentParser:
    env = environ()
    parser = argparse.ArgumentParser(prog="aserve", description=__doc__)
    parser.add_argument("--log-level", default=env.get("ASERVE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve, env)
    add_server_args(serve, env)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(gen, env)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    sub.add_parser("bench", help="replay a workload against policies and peers")
    sub.add_parser("sim", help="simulate policies at paper scale on a cost model")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("bench", "sim"):  # their own parsers take every option after
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _run_bench_module(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args, environ())
    except ValueError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from aserve.server import serve

        server_config: ServerConfig = server_config_from_args(args, environ())
        return serve(config, server_config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    return asyncio.run(_generate(config, args.prompt, params))


async def _generate(config: object, prompt: str, params: SamplingParams) -> int:
    from aserve.engine import Engine

    async with Engine(config) as engine:  # type: ignore[arg-type]
        printed = 0
        async for out in engine.generate(prompt, params):
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed = len(out.text)
        sys.stdout.write("\n")
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]",
              file=sys.stderr)
    return 0


_COMMAND_MODULES = {"bench": "bench.bench_cli", "sim": "sim.cli"}


def _run_bench_module(command: str, rest: list[str]) -> int:
    """`aserve bench|sim` run the harness in bench/ and the simulator in sim/, which ship
    with the repository: the engine itself never imports them."""
    repo = Path(__file__).resolve().parents[1]
    if (repo / "bench").is_dir() and str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    try:
        module = importlib.import_module(_COMMAND_MODULES[command])
    except ImportError as exc:
        print(f"aserve {command}: needs the repository's bench/ folder on the path ({exc})",
              file=sys.stderr)
        return 2
    return int(module.main(rest))


if __name__ == "__main__":
    raise SystemExit(main())
