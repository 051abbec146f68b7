"""The attention backend registry (models/backends.py) is the one list of names: each
registered backend builds under its name, and the config, the CLI, CUDA-graph capture and
the simulator's kernel table take their names from it."""

from __future__ import annotations

import importlib.util

import pytest

from aserve.engine.config import ATTENTION_BACKENDS, ModelConfig
from aserve.engine.cuda_graphs import GRAPH_BACKENDS as CAPTURED
from models.attention import get_backend
from models.backends import ATTENTION_KERNELS, BACKENDS, GRAPH_BACKENDS, TRITON_BACKENDS
from scheduler.cost_model import KERNELS

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_registered_backend_builds_under_its_name(name: str) -> None:
    if name in TRITON_BACKENDS and not HAS_TRITON:
        pytest.skip("triton is not installed")
    assert get_backend(name).name == name


def test_the_config_the_cli_graphs_and_the_simulator_use_the_registry() -> None:
    assert ATTENTION_BACKENDS == tuple(BACKENDS)
    assert CAPTURED is GRAPH_BACKENDS and set(GRAPH_BACKENDS) <= set(BACKENDS)
    assert set(ATTENTION_KERNELS) == set(BACKENDS)
    assert set(ATTENTION_KERNELS.values()) <= set(KERNELS)
    for name in BACKENDS:
        assert ModelConfig(attention=name).attention == name


def test_an_unknown_backend_is_refused_with_the_valid_names() -> None:
    valid = ", ".join(BACKENDS)
    with pytest.raises(ValueError, match=f"attention backend 'flash' is unknown; valid: {valid}"):
        get_backend("flash")
    with pytest.raises(ValueError, match="attention \\('flash'\\) must be one of"):
        ModelConfig(attention="flash")
