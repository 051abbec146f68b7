"""A CPU prompt step's rows rounded to `ROW_GRANULE` (aserve/engine/runner.py `_row_padding`):
the real tokens' KV and sampled tokens are those of the unpadded step, the null block stays
zeros, and decode steps are left as they are."""

from __future__ import annotations

import pytest
import torch

from aserve.engine.config import ModelConfig
from aserve.engine.runner import ROW_GRANULE, ModelRunner, WorkItem
from transport.blocks import PAD_BLOCK_ID

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    # float32: the C GEMM computes each row on its own, so padded and unpadded steps must
    # agree exactly on the real rows
    return ModelRunner(ModelConfig(model="opt-tiny", dtype="float32"), torch.device("cpu"),
                       BLOCK_SIZE)


def prompt(n: int, first_block: int, seed: int) -> WorkItem:
    ids = torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    table = list(range(first_block, first_block + -(-n // BLOCK_SIZE)))
    return WorkItem(ids, 0, table, True, 0.0, 1.0, -1, None, 0)


def kv_cache(runner: ModelRunner) -> torch.Tensor:
    cfg = runner.model_config
    kv = torch.randn(40, cfg.num_layers, 2, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    kv[PAD_BLOCK_ID] = 0
    return kv


@pytest.mark.parametrize("lens", [[37], [20, 45, 1], [300, 9]])
def test_padded_prompt_step_matches_the_unpadded_one(runner: ModelRunner,
                                                     lens: list[int]) -> None:
    items, block = [], 1
    for i, n in enumerate(lens):
        items.append(prompt(n, block, i))
        block += -(-n // BLOCK_SIZE)
    rows = sum(lens)
    _, _, meta = runner._prepare(items)
    assert meta.num_tokens % ROW_GRANULE == 0 and meta.num_tokens - rows < ROW_GRANULE
    assert meta.num_seqs == len(items) + (meta.num_tokens > rows)

    padded_kv = kv_cache(runner)
    plain_kv = padded_kv.clone()
    padded = runner.execute_sync(items, padded_kv)
    runner.pads_rows = False
    try:
        plain = runner.execute_sync(items, plain_kv)
    finally:
        runner.pads_rows = True
    assert padded.token_ids == plain.token_ids
    assert torch.equal(padded_kv, plain_kv)  # the null block included: zeros again
    assert not padded_kv[PAD_BLOCK_ID].any()


def test_decode_steps_and_short_prompts_keep_their_rows(runner: ModelRunner) -> None:
    decode = [WorkItem([7], 20, [1, 2], True, 0.0, 1.0, -1, None, 0) for _ in range(40)]
    assert runner._prepare(decode)[2].num_tokens == 40
    assert runner._prepare([prompt(ROW_GRANULE - 1, 1, 0)])[2].num_tokens == ROW_GRANULE - 1
