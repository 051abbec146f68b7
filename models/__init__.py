"""Minimal OPT in raw PyTorch: the model, attention backends over a paged KV cache, loading.

Knows tensors, never requests. The names below load on first use, so that the torch-free
modules (`models.backends`, the attention registry) import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "BACKEND_NAMES": "models.backends", "AttentionBackend": "models.attention",
    "AttentionMetadata": "models.attention", "get_backend": "models.attention",
    "write_kv": "models.attention", "DTYPES": "models.loader", "LoadedModel": "models.loader",
    "build_preset": "models.loader", "load_checkpoint": "models.loader",
    "load_model": "models.loader", "PRESETS": "models.opt", "OPTConfig": "models.opt",
    "OPTForCausalLM": "models.opt",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "BACKEND_NAMES", "DTYPES", "PRESETS", "AttentionBackend", "AttentionMetadata",
    "LoadedModel", "OPTConfig", "OPTForCausalLM", "build_preset", "get_backend",
    "load_checkpoint", "load_model", "write_kv",
]
