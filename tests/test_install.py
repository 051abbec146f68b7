"""The package installs into a fresh virtualenv outside the checkout, and the installed
`aserve bench` and `aserve sim` run there (their code and trace files travel with it).

The new environment reuses this one's third-party packages (torch among them) through a
path file, as `venv --system-site-packages` reuses a system torch, so nothing is
downloaded; the `aserve` distribution itself comes only from the fresh install.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(args: list[str | Path], cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fresh-venv")
    assert REPO not in root.parents
    _run([sys.executable, "-m", "venv", root / "venv"], root, 300)
    python = root / "venv" / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   root, 60).strip()
    # NOTE: a plain directory line: the reused site-packages' own .pth files (this
    # checkout's editable install among them) are not processed, so aserve is not visible.
    (Path(purelib) / "reuse-installed.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if Path(p).is_dir()) + "\n")
    # NOTE: the venv's own old setuptools (no bdist_wheel) would shadow the reused one.
    _run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], root, 120)
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
          f"{REPO}[bench]"], root, 600)
    return root


def test_the_installed_package_is_not_the_checkout(venv: Path) -> None:
    where = _run([venv / "venv" / "bin" / "python", "-c",
                  "import aserve, bench.workloads as w; print(aserve.__file__); "
                  "print(w.DATA_DIR)"], venv, 120).split()
    assert all(str(REPO) not in p and "site-packages" in p for p in where), where


def test_installed_aserve_bench_runs_on_opt_tiny(venv: Path) -> None:
    out = venv / "out" / "bench.json"
    _run([venv / "venv" / "bin" / "aserve", "bench", "--model", "opt-tiny", "--dtype",
          "float32", "--num-requests", "4", "--systems", "fcfs", "--offline",
          "--json", out], venv, 600)
    rows = json.loads(out.read_text())["results"]
    assert [r["system"] for r in rows] == ["fcfs/paged"]
    assert rows[0]["num_requests"] == 4 and rows[0]["decode_throughput"] > 0


def test_installed_aserve_sim_replays_a_packaged_trace(venv: Path) -> None:
    out = venv / "out" / "sim.json"
    _run([venv / "venv" / "bin" / "aserve", "sim", "--workload", "azure-conv",
          "--num-requests", "50", "--systems", "fcfs", "--kernel", "split-k",
          "--json", out], venv, 600)
    assert out.is_file()
