"""Minimal OPT in raw PyTorch: the model, attention backends over a paged KV cache, loading.

Knows tensors, never requests.
"""

from __future__ import annotations

from models.attention import (
    BACKEND_NAMES,
    AttentionBackend,
    AttentionMetadata,
    get_backend,
    write_kv,
)
from models.loader import DTYPES, LoadedModel, build_preset, load_checkpoint, load_model
from models.opt import PRESETS, OPTConfig, OPTForCausalLM

__all__ = [
    "BACKEND_NAMES", "DTYPES", "PRESETS", "AttentionBackend", "AttentionMetadata",
    "LoadedModel", "OPTConfig", "OPTForCausalLM", "build_preset", "get_backend",
    "load_checkpoint", "load_model", "write_kv",
]
