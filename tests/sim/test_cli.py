"""`aserve sim` end to end through sim.cli.main: run, calibrate, validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.workloads import synthetic
from sim.cli import main
from sim.cluster import ClusterConfig
from sim.validate import (
    ValidationRow,
    cluster_for_bench,
    cluster_from_header,
    policy_of,
    validate,
)

RUN = ["--workload", "synthetic", "--num-requests", "60", "--rate", "50", "--model",
       "opt-1.3b", "--hardware", "a100", "--prefill", "1", "--decode", "2"]


def test_run_writes_one_row_per_system_and_kernel(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code = main([*RUN, "--systems", "aligned,fcfs", "--kernel", "per-seq,split-k", "--json",
                 str(out), "--plots", str(tmp_path / "plots")])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["system"] for r in rows] == ["aligned [per-seq]", "fcfs [per-seq]",
                                           "aligned [split-k]", "fcfs [split-k]"]
    assert all(r["num_requests"] == 60 for r in rows)
    assert (tmp_path / "plots" / "throughput_tpot.png").stat().st_size > 0
    assert (tmp_path / "plots" / "tpot_cdf.png").stat().st_size > 0
    assert "aligned / fcfs [per-seq]: decode throughput" in capsys.readouterr().out


def test_bad_kernel_is_an_error_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--kernel", "flash"]) == 2
    assert "kernel ('flash')" in capsys.readouterr().out


def _write_records(path: Path) -> None:
    header = {"model": "opt-125m", "dtype": "float32", "attention": "paged",
              "prefill_devices": ["cpu"], "decode_devices": ["cpu"], "num_decode_blocks": 512,
              "host_pool_gb": 0.5}
    lines: list[dict[str, object]] = [{"header": header}]
    for b in range(1, 40):
        lines.append(dict(batch_size=b, min_len=20, max_len=20 + 10 * b, num_prefill_tokens=0,
                          forward_time=0.01 + 0.002 * b))
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_calibrate_command_saves_a_calibration_the_run_can_use(tmp_path: Path) -> None:
    records, cal = tmp_path / "run.jsonl", tmp_path / "cal.json"
    _write_records(records)
    assert main(["calibrate", str(records), "--out", str(cal)]) == 0
    doc = json.loads(cal.read_text())
    assert doc["model"] == "opt-125m" and doc["dtype_bytes"] == 4
    assert main([*RUN, "--systems", "fcfs", "--kernel", "split-k", "--calibration",
                 str(cal)]) == 0


def test_validate_prints_predicted_against_measured(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "run.jsonl"
    _write_records(records)
    header = json.loads(records.read_text().splitlines()[0])["header"]
    body = [json.loads(line) for line in records.read_text().splitlines()[1:]]
    config = cluster_from_header(header)
    assert config.decode_devices == ("cpu",) and config.num_decode_blocks == 512
    assert config.num_host_blocks == int(0.5 * 2**30 // (16 * 2 * 12 * 768 * 4))
    assert config.share_kv_memory  # the engine's default: stores of one memory hand over
    assert not cluster_from_header({**header, "share_kv_memory": False}).share_kv_memory
    workload = synthetic(20, short_range=(16, 64), long_range=(64, 128), output_range=8,
                         rate=5.0)
    measured = [{"system": "fcfs", "decode_throughput": 40.0, "tpot_p99": 0.05}]
    rows = validate(header, body, measured, workload)
    assert {r.metric for r in rows} >= {"decode_throughput", "tpot_p99"}
    assert "| fcfs | decode_throughput |" in capsys.readouterr().out
    assert ValidationRow("x", "m", 1.1, 1.0).rel_error == pytest.approx(0.1)


def test_validate_reads_bench_logs_sized_as_the_harness_sizes_the_engine() -> None:
    """`aserve bench` logs carry only model, dtype, system and workload: the cluster must
    be the one the harness built (its sizing rule), and "fcfs/paged" must run as fcfs."""
    from bench.harness import model_config, size_engine

    workload = synthetic(24, short_range=(16, 64), long_range=(64, 128), output_range=8)
    header = {"model": "opt-125m", "dtype": "bfloat16", "system": "fcfs/paged"}
    config = cluster_for_bench(header, workload)
    sizing = size_engine(workload, model_config("opt-125m"), "bfloat16", 32)
    sched = config.scheduler
    assert (config.num_decode_blocks, config.num_staging_blocks, sched.min_requests,
            sched.max_batch_size) == (sizing.num_decode_blocks, sizing.num_staging_blocks,
                                      sizing.min_requests, sizing.max_batch_size)
    assert config.num_decode_blocks != ClusterConfig().num_decode_blocks
    assert policy_of("aligned/paged") == "aligned" and policy_of("fcfs") == "fcfs"
