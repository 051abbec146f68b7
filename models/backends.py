"""The attention backends by name: one registry whose names feed the engine config's
validation, the CLI's `--attention` choices, CUDA-graph capture, the simulator's kernel
kinds and the GPU checks.

Torch-free (each backend is built through its import path, on demand), so the config, the
CLI and the simulator read the names without loading torch or the optional Triton.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One attention backend: its name and how it is built and used."""

    name: str
    factory: str  # "module:class" of the backend (imported when first built)
    kernel: str  # the decode kernel's kind, as the simulator's cost model names it
    triton: bool = False  # its decode runs Triton kernels (a GPU, or Triton's interpreter)
    graphs: bool = False  # its decode launches do not depend on the lengths, so a CUDA
    # graph captured once replays for any batch of the same size


BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("paged", "models.attention:PagedBackend", "split-k"),
    BackendSpec("padded", "models.attention:PaddedBackend", "padded"),
    BackendSpec("triton", "models.triton_attention:TritonDecodeBackend", "per-seq",
                triton=True, graphs=True),
    # Longest-first issue order; the argsort of the lengths is not yet checked under CUDA
    # graph capture (no GPU was lent), so it runs eagerly.
    BackendSpec("triton-lpt", "models.triton_attention:TritonLongestFirstBackend",
                "per-seq-lpt", triton=True),
    BackendSpec("triton-splitk", "models.triton_attention:TritonSplitKBackend", "split-k",
                triton=True, graphs=True),
)}
BACKEND_NAMES = tuple(BACKENDS)
GRAPH_BACKENDS = tuple(name for name, spec in BACKENDS.items() if spec.graphs)
TRITON_BACKENDS = tuple(name for name, spec in BACKENDS.items() if spec.triton)
TORCH_BACKENDS = tuple(name for name, spec in BACKENDS.items() if not spec.triton)
ATTENTION_KERNELS = {name: spec.kernel for name, spec in BACKENDS.items()}  # -> kernel kind


def backend_spec(name: str) -> BackendSpec:
    """The registered backend `name`; raises ValueError listing the valid names."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; valid: "
                         f"{', '.join(BACKEND_NAMES)}")
    return BACKENDS[name]


def build_backend(name: str) -> Any:
    """A new backend `name` (an `models.attention.AttentionBackend`)."""
    module, cls = backend_spec(name).factory.split(":")
    return getattr(importlib.import_module(module), cls)()
