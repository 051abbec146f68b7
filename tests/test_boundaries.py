"""The package boundaries of docs/design.md, checked on what an import actually loads:
the engine and its entry points never load the simulator or the benchmark library, and the
cores and the scheduler load neither torch nor asyncio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded(statement: str) -> set[str]:
    """Top-level packages in sys.modules after `statement`, run in a fresh interpreter."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return {name.split(".")[0] for name in json.loads(out.splitlines()[-1])}


def test_the_engine_and_server_load_neither_sim_nor_bench() -> None:
    loaded = _loaded("import aserve, aserve.entrypoints.server, aserve.engine.engine\n"
                     "from aserve import Engine, LLM")
    assert "torch" in loaded  # the statement did load the engine
    assert not loaded & {"sim", "bench"}, loaded & {"sim", "bench"}


@pytest.mark.parametrize("module", ["aserve.cores", "scheduler", "scheduler.calibrate",
                                    "aserve.engine.sequence"])
def test_pure_modules_load_no_torch_and_no_asyncio(module: str) -> None:
    loaded = _loaded(f"import {module}")
    assert not loaded & {"torch", "asyncio", "models"}, loaded & {"torch", "asyncio", "models"}
