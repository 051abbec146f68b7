"""Where the Ray driver places instances and KV stores, and its configuration errors."""

from __future__ import annotations

import pytest

from aserve.cluster.engine import ClusterEngine, holders, instances
from aserve.cores import kv_stores
from aserve.engine.config import CacheConfig, EngineConfig


def test_the_pool_and_candidate_buffers_live_on_the_prefill_side() -> None:
    stores = kv_stores(("cpu", "cpu"), ("cpu", "cpu", "cpu"), CacheConfig(), 64)
    held = holders(stores, 2, uses_pool=True)
    assert held == {"prefill0": "prefill0", "prefill1": "prefill1", "decode0": "decode0",
                    "decode1": "decode1", "decode2": "decode2", "staging0": "prefill0",
                    "staging1": "prefill1", "staging2": "prefill0", "host": "prefill0"}
    assert set(held.values()) == set(instances(("cpu",) * 2, ("cpu",) * 3, True))


def test_without_a_pool_only_the_decode_caches_are_placed() -> None:
    stores = kv_stores(("cpu",), ("cpu", "cpu"), CacheConfig(), 64)
    assert holders(stores, 1, uses_pool=False) == {"decode0": "decode0", "decode1": "decode1"}
    assert instances(("cpu",), ("cuda", "cpu"), False) == {
        "decode0": ("cuda", "aserve_decode"), "decode1": ("cpu", "aserve_decode")}


def test_a_cluster_engine_needs_an_address() -> None:
    with pytest.raises(ValueError, match="ray_address must name a Ray cluster"):
        ClusterEngine(EngineConfig.create(model="opt-tiny"))
    with pytest.raises(ValueError, match="ray_address must be 'auto' or HOST:PORT"):
        EngineConfig.create(ray_address=" ")
