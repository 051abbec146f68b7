"""The `aserve` command: `serve`, `generate`, `bench` and `sim`.

Arguments and ASERVE_* variables are parsed in args.py; this file dispatches.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Sequence

from aserve import __version__
from aserve.engine.config import ServerConfig
from aserve.engine.sequence import SamplingParams
from aserve.entrypoints.args import (
    HELP_FORMATTER,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    environ,
    server_config_from_args,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _parser() -> argparse.ArgumentParser:
    env = environ()
    parser = argparse.ArgumentParser(
        prog="aserve", description=__doc__, formatter_class=HELP_FORMATTER,
        epilog="Every option of serve and generate defaults to its ASERVE_<NAME> environment "
               "variable when that is set. `aserve bench --help` and `aserve sim --help` "
               "describe theirs.")
    parser.add_argument("--version", action="version", version=f"aserve {__version__}")
    parser.add_argument("--log-level", default=env.get("ASERVE_LOG_LEVEL", "INFO"),
                        choices=LOG_LEVELS, type=str.upper, help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Runs the OpenAI-compatible HTTP server.",
                           formatter_class=HELP_FORMATTER)
    add_engine_args(serve, env)
    add_server_args(serve, env)
    gen = sub.add_parser("generate", help="generate a completion for one prompt",
                         description="Streams one completion to the terminal.",
                         formatter_class=HELP_FORMATTER)
    add_engine_args(gen, env)
    d = SamplingParams()
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=d.top_p, help="nucleus mass in (0, 1]")
    gen.add_argument("--top-k", type=int, default=d.top_k,
                     help="keep the k most likely tokens; -1 or 0: all")
    gen.add_argument("--sampling-seed", type=int, default=d.seed,
                     help="this request's own seed; None: drawn from the --seed RNG")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    sub.add_parser("bench", help="replay a workload against policies and peers "
                   "(`aserve bench --help`)", add_help=False)
    sub.add_parser("sim", help="simulate policies at paper scale on a cost model "
                   "(`aserve sim --help`)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("bench", "sim"):  # their own parsers take every option after
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _run_bench_module(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args, environ())
        if args.command == "serve":
            from aserve.entrypoints.server import serve

            server_config: ServerConfig = server_config_from_args(args, environ())
            return serve(config, server_config)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                                ignore_eos=args.ignore_eos)
        return asyncio.run(_generate(config, args.prompt, params))
    except ValueError as exc:  # bad options or files, found while parsing or starting up
        logging.getLogger(__name__).debug("start-up failed", exc_info=True)
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2


async def _generate(config: object, prompt: str, params: SamplingParams) -> int:
    from aserve.cluster import engine_for

    async with engine_for(config) as engine:  # type: ignore[arg-type]
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
    """`aserve bench|sim` run the installed benchmark library (bench/) and simulator (sim/);
    the engine itself never imports them. Their plotting and progress bars come with the
    `bench` extra."""
    try:
        module = importlib.import_module(_COMMAND_MODULES[command])
    except ImportError as exc:
        print(f"aserve {command}: {exc}; install the benchmark extra: "
              f"pip install 'aserve[bench]'", file=sys.stderr)
        return 2
    return int(module.main(rest))


if __name__ == "__main__":
    raise SystemExit(main())
