"""The `aserve` command explains itself: every option of serve, generate, bench and sim has
help that states its default, choices come from the registries, `--version` works, and the
two seeds do what their help says."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aserve.engine.config import ATTENTION_BACKENDS
from aserve.entrypoints import cli
from aserve.entrypoints.args import add_engine_args, engine_config_from_args
from bench import bench_cli, peers
from bench.harness import Sizing
from models.loader import load_model
from scheduler import POLICIES
from sim import cli as sim_cli
from tests.hub_checkpoint import write_hub_checkpoint


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    top = cli._parser()
    subs = _subparsers(top)
    return {"aserve": top, "serve": subs["serve"], "generate": subs["generate"],
            "bench": bench_cli._parser(), "sim": sim_cli._run_parser()}


@pytest.mark.parametrize("name", ["aserve", "serve", "generate", "bench", "sim"])
def test_every_option_has_help_that_shows_its_default(name: str) -> None:
    parser = _parsers()[name]
    options = [a for a in parser._actions
               if a.option_strings and not isinstance(a, (argparse._HelpAction,
                                                          argparse._VersionAction))]
    assert options
    lacking = [a.option_strings[0] for a in options if not (a.help or "").strip()]
    assert lacking == [], f"{name}: options without help: {lacking}"
    text = parser.format_help()
    for action in options:
        if action.default is not argparse.SUPPRESS:
            shown = parser._get_formatter()._expand_help(action)  # the help line as printed
            assert "default" in shown, f"{name} {action.option_strings[0]}: {shown!r}"
        assert action.option_strings[0] in text


def test_serve_help_lists_choices_from_the_registries() -> None:
    result = subprocess.run([sys.executable, "-m", "aserve.entrypoints.cli", "serve", "--help"],
                            capture_output=True, text=True, timeout=120, check=True)
    assert "{" + ",".join(sorted(POLICIES)) + "}" in result.stdout
    assert "{" + ",".join(ATTENTION_BACKENDS) + "}" in result.stdout
    assert "--max-num-seqs" in result.stdout and "(default: 256)" in result.stdout


def test_version_prints_the_package_version() -> None:
    from aserve import __version__

    result = subprocess.run([sys.executable, "-m", "aserve.entrypoints.cli", "--version"],
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == f"aserve {__version__}"
    assert __version__ != "0+unknown"  # the checkout is installed (make setup)


def test_seeds_and_vllm_flags_reach_the_config() -> None:
    serve = _parsers()["serve"]
    args = serve.parse_args(["--model", "opt-tiny", "--seed", "7", "--weights-seed", "3",
                             "--max-num-seqs", "9", "--max-model-len", "512",
                             "--tokenizer", "bytes"])
    config = engine_config_from_args(args, {})
    assert (config.seed, config.model.weights_seed) == (7, 3)
    assert config.scheduler.max_batch_size == 9
    assert config.model.max_position_embeddings == 512 and config.model.tokenizer == "bytes"


def test_environment_variables_are_typed_defaults() -> None:
    env = {"ASERVE_SEED": "11", "ASERVE_WEIGHTS_SEED": "4", "ASERVE_POLICY": "fcfs"}
    serve = argparse.ArgumentParser()
    add_engine_args(serve, env)
    config = engine_config_from_args(serve.parse_args([]), env)
    assert (config.seed, config.model.weights_seed, config.scheduler.policy) == (11, 4, "fcfs")


def test_bench_seed_gives_the_engine_and_the_transformers_peer_the_same_weights() -> None:
    settings = bench_cli.BenchSettings(model="opt-tiny", dtype="float32", seed=3)
    sizing = Sizing(block_size=16, num_decode_blocks=64, num_prefill_blocks=64,
                    num_staging_blocks=64, max_batch_size=8, min_requests=2,
                    host_pool_gb=0.01, pool_ratio=1.0)
    config = bench_cli.engine_config("fcfs/paged", sizing, settings)
    engine_model, _ = load_model(config.model.model, config.model.dtype, "cpu",
                                 seed=config.model.weights_seed)
    peer = peers.build_hf_model("opt-tiny", "float32", settings.seed)
    ours = engine_model.model.decoder.embed_tokens.weight
    assert torch.equal(ours, peer.model.decoder.embed_tokens.weight)
    seed0, _ = load_model("opt-tiny", "float32", "cpu", seed=0)
    assert not torch.equal(ours, seed0.model.decoder.embed_tokens.weight)


def test_checkpoint_without_tokenizer_files_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub = write_hub_checkpoint(tmp_path / "hub")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        (bare / name).write_bytes((hub / name).read_bytes())
    capsys.readouterr()  # transformers' progress bars
    assert cli.main(["generate", "--model", str(bare), "--max-tokens", "2", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aserve: error: {bare} has no tokenizer files")
    assert "--tokenizer" in err
    args = ["generate", "--model", str(bare), "--max-tokens", "3", "--ignore-eos", "Hi"]
    assert cli.main([*args, "--tokenizer", str(hub)]) == 0
    assert "[3 tokens, finish_reason=length]" in capsys.readouterr().err


def test_every_engine_config_field_is_a_serve_option() -> None:
    import msgspec

    from aserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    dests = {a.dest for a in _parsers()["serve"]._actions}
    fields = {f.name for s in (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig)
              for f in msgspec.structs.fields(s)} - {"model", "cache", "scheduler"}
    assert fields - dests == set(), fields - dests
    assert "model" in dests  # ModelConfig.model, the weights


def test_every_policy_knob_reaches_the_config_from_serve() -> None:
    from scheduler import PolicyConfig

    args = _parsers()["serve"].parse_args([
        "--min-requests", "3", "--leaf-width", "32", "--starvation-threshold", "off",
        "--match-slack", "0.5", "--max-spread", "2", "--drain-floor", "0.2",
        "--batch-kv-fraction", "0.8", "--no-cuda-graphs"])
    config = engine_config_from_args(args, {})
    knobs = PolicyConfig.of(config.scheduler, max_len=1)
    assert (knobs.min_requests, knobs.leaf_width, knobs.starvation_threshold,
            knobs.match_slack, knobs.max_spread, knobs.drain_floor) == (3, 32, None, 0.5, 2.0,
                                                                        0.2)
    assert config.scheduler.batch_kv_fraction == 0.8 and config.model.cuda_graphs is False
    env = {"ASERVE_STARVATION_THRESHOLD": "off", "ASERVE_MAX_SPREAD": "1.25",
           "ASERVE_CUDA_GRAPHS": "0"}
    parser = argparse.ArgumentParser()
    add_engine_args(parser, env)
    config = engine_config_from_args(parser.parse_args([]), env)
    assert config.scheduler.starvation_threshold is None
    assert config.scheduler.max_spread == 1.25 and config.model.cuda_graphs is False
