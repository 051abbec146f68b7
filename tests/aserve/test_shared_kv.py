"""KV stores in one memory share one tensor: on a CPU-only engine the prefill scratch,
staging buffer, host pool and decode cache are one KV tensor, and every move between them
hands the block table over instead of copying (transport/blocks.py). What a user relies on:
the same tokens as with a tensor per store, every block freed, and no copy made."""

from __future__ import annotations

import asyncio

import pytest

from aserve import Engine, SamplingParams
from tests.aserve.test_engine import settle
from tests.conftest import make_config, make_prompts

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


async def _serve(share: bool, policy: str) -> tuple[list[list[int]], Engine]:
    # a decode cache of 24 blocks for 8 requests growing to ~60 tokens: switches, evictions
    config = make_config(policy=policy, share_kv_memory=share, num_decode_blocks=24)
    async with Engine(config) as engine:
        prompts = make_prompts(8, 8, 40, 512, seed=3)
        outs = await asyncio.gather(*(engine.complete(p, PARAMS) for p in prompts))
        await settle(engine)
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("policy", ["aligned", "fcfs"])
async def test_shared_stores_hand_over_and_give_the_same_tokens(policy: str) -> None:
    shared, engine = await _serve(True, policy)
    kv = engine.ctx.kv  # type: ignore[union-attr]
    tensors = {store.tensor.data_ptr() for store in kv.stores.values()}
    assert len(tensors) == 1  # one memory, one tensor
    assert not kv.copier._engines  # no copy engine was ever asked for: nothing was copied
    paths = {(t.src.rstrip("0"), t.dst.rstrip("0")) for t in kv.transfers}
    assert {("prefill", "host"), ("host", "staging"), ("staging", "decode")} <= paths
    assert all(t.end_time == t.start_time for t in kv.transfers)
    apart, engine = await _serve(False, policy)
    assert len({s.tensor.data_ptr() for s in engine.ctx.kv.stores.values()}) == 4  # type: ignore[union-attr]
    assert shared == apart
