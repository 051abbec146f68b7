"""The vLLM peer's parts that run without vLLM: the checkpoint it is handed holds exactly the
weights our engine runs, its documented CPU settings, and a clear error without its
virtualenv. (The peer itself runs only in `aserve bench --systems vllm`, never in tests.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import peers
from bench.workloads import synthetic
from models.loader import load_model


def test_saved_checkpoint_holds_the_engines_weights(tmp_path: Path) -> None:
    folder = peers.save_checkpoint("opt-tiny", "float32", 3, tmp_path / "ckpt")
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    ours, _ = load_model("opt-tiny", "float32", "cpu", seed=3)
    loaded, _ = load_model(str(folder), "float32", "cpu")
    for (name, a), (_, b) in zip(ours.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_vllm_env_binds_every_core_and_preloads_its_openmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the legacy variable would override the KV memory the driver is given
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    env = peers.vllm_env(tmp_path, 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_missing_virtualenv_names_make_peers(tmp_path: Path) -> None:
    workload = synthetic(2, 1.0, short_range=(4, 8), output_range=2)
    with pytest.raises(RuntimeError, match="make peers"):
        peers.run_vllm("opt-tiny", "float32", 0, workload, [[5, 6], [7, 8]],
                       venv=tmp_path / "absent")
