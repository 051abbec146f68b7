"""Fixtures for transport tests: a small KV geometry."""

from __future__ import annotations

import pytest
import torch

from transport.kv import KVGeometry

BLOCK_SIZE = 4  # tokens


@pytest.fixture
def geometry() -> KVGeometry:
    return KVGeometry(
        num_layers=2, num_heads=2, head_dim=8, block_size=BLOCK_SIZE, dtype=torch.float32
    )
