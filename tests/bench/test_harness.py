"""The benchmark harness on `opt-tiny`: the CLI's JSON and iteration logs, the transformers
peer's tokens against our engine's, client mode against our real server, engine sizing and
the event-loop lag probe."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aserve.engine.config import EngineConfig, ServerConfig
from aserve.engine.sequence import IterationRecord
from bench import bench_cli, peers
from bench.harness import (
    LoopLagProbe,
    RunResult,
    model_config,
    read_iteration_log,
    run_engine,
    size_engine,
    workload_prompts,
    write_iteration_log,
)
from bench.http_client import chunk_token_count, run_http
from bench.workloads import Workload, synthetic

TINY = "opt-tiny"


def tiny_workload(num_requests: int = 6, rate: float | None = None) -> Workload:
    return synthetic(num_requests, 0.5, short_range=(4, 40), long_range=(60, 120),
                     output_range=(3, 12), rate=rate, seed=3)


def tiny_engine_config(workload: Workload, policy: str) -> EngineConfig:
    sizing = size_engine(workload, model_config(TINY), "float32", batch_requests=2)
    return EngineConfig.create(model=TINY, dtype="float32", policy=policy, **sizing.options())


def test_cli_writes_documented_json_for_two_policies(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    code = bench_cli.main(["--", "--model", TINY, "--dtype", "float32", "--num-requests", "6",
                           "--short-ratio", "0.5", "--systems", "fcfs,continuous", "--offline",
                           "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"config", "results", "runs"}
    assert [(r["system"], r["repeat"]) for r in doc["runs"]] == [
        ("fcfs/paged", 0), ("continuous/paged", 0)]
    assert doc["config"]["model"] == TINY and doc["config"]["num_requests"] == 6
    workload = synthetic(6, 0.5, length_scale=bench_cli.DEFAULT_LENGTH_SCALE, max_len=4096)
    expected_tokens = sum(r.output_len for r in workload.requests)
    rows = {row["system"]: row for row in doc["results"]}
    assert set(rows) == {"fcfs/paged", "continuous/paged"}
    for row in rows.values():
        assert row["num_requests"] == 6 and row["num_output_tokens"] == expected_tokens
        assert row["decode_throughput"] > 0 and row["ttft_p99"] >= row["ttft_p50"] > 0
        assert row["workload"] == "synthetic-s0.5"
    assert "decode tok/s vs fcfs/paged" in out.with_suffix(".md").read_text()
    header, records = read_iteration_log(
        out.with_suffix(".iterations") / "synthetic-s0.5__fcfs-paged.jsonl")
    assert header == {"model": TINY, "dtype": "float32", "system": "fcfs/paged",
                      "workload": "synthetic-s0.5", "share_kv_memory": True,
                      "fuse_steps": True}
    assert records and all(r.batch_size >= 1 for r in records)
    # the start-up probe's steps come first: every log calibrates over batch sizes
    probed = [r for r in records if r.instance == "probe"]
    assert probed and records[:len(probed)] == probed
    assert max(r.batch_size for r in probed) > max(r.batch_size for r in records
                                                   if r.instance.startswith("decode"))


def test_cli_repeats_rotate_the_order_and_report_medians(tmp_path: Path) -> None:
    out = tmp_path / "rep.json"
    code = bench_cli.main(["--model", TINY, "--dtype", "float32", "--num-requests", "4",
                           "--short-ratio", "0.5", "--systems", "fcfs,continuous", "--offline",
                           "--repeats", "3", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    order = [(r["system"], r["repeat"]) for r in doc["runs"]]
    assert order == [("fcfs/paged", 0), ("continuous/paged", 0), ("continuous/paged", 1),
                     ("fcfs/paged", 1), ("fcfs/paged", 2), ("continuous/paged", 2)]
    for row in doc["results"]:
        runs = sorted(r["decode_throughput"] for r in doc["runs"] if r["system"] == row["system"])
        assert row["decode_throughput"] == runs[1]  # the median of three
        assert all(r["num_output_tokens"] == row["num_output_tokens"]
                   for r in doc["runs"] if r["system"] == row["system"])
    steal = [r["cpu_steal"] for r in doc["runs"]]
    assert all(s is None or 0 <= s <= 1 for s in steal)
    table = out.with_suffix(".md").read_text()
    assert "CPU steal % per run" in table and "decode-only steps (forward s) per run" in table
    logs = sorted(p.name for p in out.with_suffix(".iterations").iterdir())
    assert logs == [f"synthetic-s0.5__{s}-paged__r{r}.jsonl"
                    for s in ("continuous", "fcfs") for r in range(3)]
    assert bench_cli.main(["--repeats", "0", "--json", str(tmp_path / "x.json")]) == 2


def test_cli_rotation_goes_on_across_workloads_so_no_system_is_always_first(
        tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    code = bench_cli.main(["--model", TINY, "--dtype", "float32", "--num-requests", "3",
                           "--short-ratio", "0.5,1.0", "--systems", "fcfs,continuous",
                           "--repeats", "2", "--offline", "--json", str(out)])
    assert code == 0
    order = [(r["workload"], r["system"]) for r in json.loads(out.read_text())["runs"]]
    # Two systems, two repeats: a rotation restarted at i * repeats would put fcfs first
    # on both workloads.
    assert order == [("synthetic-s0.5", "fcfs/paged"), ("synthetic-s0.5", "continuous/paged"),
                     ("synthetic-s0.5", "continuous/paged"), ("synthetic-s0.5", "fcfs/paged"),
                     ("synthetic-s1", "continuous/paged"), ("synthetic-s1", "fcfs/paged"),
                     ("synthetic-s1", "fcfs/paged"), ("synthetic-s1", "continuous/paged")]


def test_cli_warm_up_run_goes_first_and_is_left_out(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, str]] = []
    real = bench_cli.run_system

    def recording(name: str, workload: Workload, *args: object) -> RunResult:
        ran.append((workload.name, name))
        return real(name, workload, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_cli, "run_system", recording)
    out = tmp_path / "warm.json"
    code = bench_cli.main(["--model", TINY, "--dtype", "float32", "--num-requests", "3",
                           "--short-ratio", "0.5,1.0", "--systems", "fcfs,continuous",
                           "--offline", "--json", str(out)])  # --warmup-runs 1 by default
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    # one warm-up run, of the first system on the first workload, then the measured ones
    assert ran == [("synthetic-s0.5", "fcfs/paged"), *((r["workload"], r["system"]) for r in runs)]
    assert len(runs) == 4 and all(r["repeat"] == 0 for r in runs)
    ran.clear()
    assert bench_cli.main(["--model", TINY, "--dtype", "float32", "--num-requests", "3",
                           "--systems", "fcfs", "--offline", "--warmup-runs", "0",
                           "--json", str(tmp_path / "cold.json")]) == 0
    assert len(ran) == 1
    assert bench_cli.main(["--warmup-runs", "-1", "--json", str(tmp_path / "x.json")]) == 2


def test_forward_split_separates_prompt_steps_from_decode_work() -> None:
    def step(instance: str, prompt_tokens: int, batch: int, seconds: float) -> IterationRecord:
        return IterationRecord(instance, 0.0, batch, prompt_tokens, 1, 9, seconds, 0.0,
                               False, {})

    result = RunResult("fcfs/paged", [], [step("decode0", 0, 4, 0.25), step("decode0", 0, 0, 9.0),
                                          step("decode0", 6, 3, 0.5), step("decode0", 0, 2, 0.5)],
                       {}, 1.0, prefill_iterations=[step("prefill0", 30, 2, 2.0)])
    # an idle step (no seqs) is neither; a mixed step with prompt tokens counts as a prompt step
    assert bench_cli.forward_split(result) == (2.5, 0.75, 2)


def test_cli_rejects_unknown_system(tmp_path: Path) -> None:
    code = bench_cli.main(["--systems", "sglang", "--json", str(tmp_path / "x.json")])
    assert code == 2 and not (tmp_path / "x.json").exists()


def test_system_names_expand_policies_over_backends() -> None:
    names = bench_cli.system_names(["aligned", "transformers"], ["paged", "padded"])
    assert names == ["aligned/paged", "aligned/padded", "transformers"]


def _engine_run(workload: Workload, policy: str = "fcfs", realtime: bool = False) -> RunResult:
    prompts = workload_prompts(workload, model_config(TINY).vocab_size, seed=0)
    return asyncio.run(run_engine(workload, prompts, tiny_engine_config(workload, policy),
                                  policy, realtime=realtime))


@pytest.fixture(scope="module")
def engine_run() -> RunResult:
    return _engine_run(tiny_workload())


@pytest.fixture(scope="module")
def hf_model() -> object:
    return peers.build_hf_model(TINY, "float32")


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_peer_produces_engine_greedy_tokens(mode: str, engine_run: RunResult,
                                            hf_model: object) -> None:
    workload = tiny_workload()
    prompts = workload_prompts(workload, model_config(TINY).vocab_size, seed=0)
    run = peers.run_static_generate if mode == "static" else peers.run_continuous_batching
    result = run(hf_model, workload, prompts, realtime=False)  # type: ignore[arg-type]
    assert result.token_ids == engine_run.token_ids
    summary = result.summary()
    assert summary.num_requests == 6
    assert summary.num_output_tokens == sum(r.output_len for r in workload.requests)


def test_engine_run_drops_warm_up_and_counts_every_token(engine_run: RunResult) -> None:
    workload = tiny_workload()
    assert sorted(engine_run.token_ids) == sorted(r.request_id for r in workload.requests)
    assert {e.seq_id for e in engine_run.events} == set(engine_run.token_ids)
    for req in workload.requests:
        assert len(engine_run.token_ids[req.request_id]) == req.output_len


def test_realtime_replay_submits_at_arrival_times() -> None:
    workload = tiny_workload(4, rate=5.0)
    result = _engine_run(workload, realtime=True)
    arrivals = sorted(e.time for e in result.events if e.kind == "arrival")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    expected = [b.arrival_time - a.arrival_time
                for a, b in zip(workload.requests, workload.requests[1:])]
    assert gaps == pytest.approx(expected, abs=0.05)


def test_sizing_leaves_pool_larger_than_decode_and_fits_longest() -> None:
    workload = synthetic(256, 0.95, length_scale=0.125, max_len=2048)
    sizing = size_engine(workload, model_config("opt-125m"), "bfloat16", batch_requests=32)
    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    assert sizing.pool_ratio > 2
    assert 0.9 * sizing.num_decode_blocks * sizing.block_size >= longest
    assert sizing.num_staging_blocks >= sizing.num_decode_blocks
    # what a peer is given for equal memory: opt-125m's 12 layers x K,V x 768 channels, bf16
    assert sizing.decode_kv_bytes == sizing.num_decode_blocks * 16 * 12 * 2 * 768 * 2


def test_iteration_log_round_trips(tmp_path: Path) -> None:
    records = [IterationRecord("decode0", 1.0, 4, 0, 10, 14, 0.01, 0.001, False,
                               {"decode": 3, "host": 9}),
               IterationRecord("prefill0", 1.5, 2, 30, 10, 20, 0.02, 0.0, False, {},
                               lengths=(10, 20), new_tokens=(10, 20))]
    path = tmp_path / "it.jsonl"
    write_iteration_log(path, {"model": TINY, "dtype": "float32", "system": "aligned"}, records)
    assert read_iteration_log(path) == ({"model": TINY, "dtype": "float32",
                                         "system": "aligned"}, records)


def test_iteration_logs_written_before_new_tokens_still_read(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    old = {"instance": "prefill0", "start_time": 1.5, "batch_size": 2, "num_prefill_tokens": 30,
           "min_len": 10, "max_len": 20, "forward_time": 0.02, "schedule_time": 0.0,
           "is_mixed": False, "blocks_used": {}, "prefill_lengths": [10, 20]}
    path.write_text(json.dumps({"header": {"model": TINY}}) + "\n" + json.dumps(old) + "\n")
    _, [record] = read_iteration_log(path)
    assert record.lengths == (10, 20) and record.new_tokens == (10, 20)


async def test_loop_lag_probe_sees_a_blocked_loop() -> None:
    async with LoopLagProbe(interval=0.002) as probe:
        await asyncio.sleep(0.02)
        time.sleep(0.1)  # blocks the event loop on purpose
        await asyncio.sleep(0.02)
    assert probe.max_lag >= 0.08 and probe.p99_lag <= probe.max_lag


def test_chunk_token_count_prefers_logprobs() -> None:
    assert chunk_token_count({"text": "ab", "logprobs": {"tokens": ["a", "b"]}}) == 2
    assert chunk_token_count({"text": "", "logprobs": {"tokens": ["\ufffd"]}}) == 1
    assert chunk_token_count({"text": "x", "logprobs": None}) == 1
    assert chunk_token_count({"text": "", "logprobs": None}) == 0


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    from tests.aserve.conftest import LiveServer

    workload = tiny_workload()
    server = LiveServer(tiny_engine_config(workload, "fcfs"), ServerConfig(port=0))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_client_mode_counts_every_streamed_token(live_url: str) -> None:
    workload = tiny_workload(rate=20.0)
    prompts = workload_prompts(workload, model_config(TINY).vocab_size, seed=0)
    result = asyncio.run(run_http(live_url, workload, prompts))
    summary = result.summary()
    assert summary.num_requests == 6
    assert summary.num_output_tokens == sum(r.output_len for r in workload.requests)
    assert summary.ttft_mean > 0 and summary.tpot_mean > 0
