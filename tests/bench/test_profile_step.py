"""bench.profile_step: the split of a step's time on a grouped-query model too, for each
phase (a profile that ran on the wrong cache geometry would fail or measure nothing)."""

from __future__ import annotations

import pytest
import torch

from aserve.engine.config import ModelConfig
from aserve.engine.runner import ModelRunner
from bench.profile_step import BLOCK_SIZE, PARTS, profile_step, work


def test_a_mixed_step_is_the_decode_batch_beside_one_prompt() -> None:
    items, num_blocks = work(3, 20, "mixed", vocab=100)
    assert [len(i.token_ids) for i in items] == [1, 1, 1, 20]
    assert [i.start for i in items] == [20, 20, 20, 0]
    assert num_blocks == 1 + 4 * -(-21 // BLOCK_SIZE)


@pytest.mark.parametrize("phase", ["decode", "mixed", "prefill"])
def test_every_phase_profiles_a_gqa_model(phase: str) -> None:
    runner = ModelRunner(ModelConfig(model="llama-tiny", dtype="float32"), torch.device("cpu"),
                         BLOCK_SIZE)
    try:
        ms, parts = profile_step(runner, 2, 24, phase, repeats=1, dtype="float32")
    finally:
        runner.shutdown()
    assert ms > 0
    assert parts["attention"] > 0 and parts["linear"] > 0, parts
    assert set(PARTS) <= set(parts)
