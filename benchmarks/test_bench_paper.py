"""The paper's figures at CPU scale on `opt-125m` (`pytest bench -m bench`, not CI): the Fig. 7
short-share sweep with Figs. 13/14 from the same runs, the Azure `code` replay for every
policy, two identical runs for the spread, and client mode against our own server.

Each test runs one `aserve bench` command; results land in benchmarks/results/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.bench_cli import HTTP_SYSTEM
from bench.harness import model_config, size_engine
from bench.workloads import synthetic
from benchmarks.test_bench_engine import RESULTS, run_cli, throughput

pytestmark = pytest.mark.bench
POLICIES = "aligned,aligned-strict,aligned-loose,aligned-noprefetch,fcfs,continuous"
SWEEP_BUDGET_S = 20 * 60  # the Fig. 7 + 13/14 command must finish within this
REPEAT_TOLERANCE = 0.10  # two runs agree within 10 % on decode throughput
HTTP_TOLERANCE = 0.15  # client mode within 15 % of the in-process run
REPO = Path(__file__).resolve().parent.parent

# The ONE documented command behind Figs. 7, 13 and 14.
SHORT_RATIOS = "0.7,0.8,0.9,0.95"
FIG7_ARGS = ["--workload", "synthetic", "--short-ratio", SHORT_RATIOS,
             "--num-requests", "128", "--offline", "--systems", POLICIES,
             "--model", "opt-125m", "--dtype", "bfloat16", "--plots", str(RESULTS / "fig7")]


def test_fig7_sweep_and_fig13_fig14(tmp_path: Path) -> None:
    start = time.perf_counter()
    doc = run_cli("fig7_sweep", FIG7_ARGS, tmp_path)
    elapsed = time.perf_counter() - start
    print(f"Fig. 7/13/14 command took {elapsed / 60:.1f} min "
          f"(budget {SWEEP_BUDGET_S / 60:.0f} min)")
    for name in ("fig7_short_share", "fig13_forward_time_cdf", "fig14_ablation"):
        assert (RESULTS / "fig7" / f"{name}.png").is_file()
    expected = len(POLICIES.split(",")) * len(SHORT_RATIOS.split(","))
    assert len(doc["results"]) == expected  # type: ignore[arg-type]
    assert elapsed < SWEEP_BUDGET_S


def test_azure_code_replay_every_policy(tmp_path: Path) -> None:
    doc = run_cli("azure_code", [
        "--workload", "azure-code", "--num-requests", "100", "--length-scale", "0.125",
        "--rate", "4", "--systems", POLICIES, "--attention", "paged",
        "--plots", str(RESULTS / "azure_code")], tmp_path)
    rows = doc["results"]
    assert isinstance(rows, list) and all(r["num_requests"] == 100 for r in rows)


def test_two_runs_agree(tmp_path: Path) -> None:
    args = ["--workload", "synthetic", "--short-ratio", "0.95", "--num-requests", "128",
            "--offline", "--systems", "aligned,fcfs"]
    first = run_cli("repeat_1", args, tmp_path)
    second = run_cli("repeat_2", args, tmp_path)
    for system in ("aligned/paged", "fcfs/paged"):
        a, b = throughput(first, system), throughput(second, system)
        spread = abs(a - b) / min(a, b)
        print(f"{system}: {a:.1f} vs {b:.1f} tok/s, spread {spread:.1%}")
        assert spread <= REPEAT_TOLERANCE


def _serve(policy: str, port: int, sizing_args: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "aserve.entrypoints.cli", "serve", "--model", "opt-125m",
           "--dtype", "bfloat16", "--policy", policy, "--port", str(port), *sizing_args]
    server = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise AssertionError(f"server on port {port} did not come up")


@pytest.mark.parametrize("load", ["rate4", "offline"])
def test_http_client_matches_in_process(load: str, tmp_path: Path) -> None:
    policy, rate = "fcfs", (4.0 if load == "rate4" else None)
    arrivals = ["--rate", "4"] if rate else ["--offline"]
    args = ["--workload", "synthetic", "--short-ratio", "0.95", "--num-requests", "128",
            *arrivals, "--systems", policy]
    workload = synthetic(128, 0.95, length_scale=0.125, rate=rate, max_len=2048)
    sizing = size_engine(workload, model_config("opt-125m"), "bfloat16", batch_requests=32)
    sizing_args = [f"--{k.replace('_', '-')}={v}" for k, v in sizing.options().items()]
    port = 18931
    server = _serve(policy, port, sizing_args)
    try:
        doc = run_cli(f"http_vs_in_process_{load}", [*args, "--url", f"http://127.0.0.1:{port}"],
                      tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=30)
    local, remote = throughput(doc, f"{policy}/paged"), throughput(doc, HTTP_SYSTEM)
    gap = abs(remote - local) / local
    print(f"in-process {local:.1f} tok/s, HTTP client {remote:.1f} tok/s, gap {gap:.1%}")
    assert gap <= HTTP_TOLERANCE
