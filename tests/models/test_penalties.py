"""Penalties in the batched sampler: only the rows that ask for them change, logprobs stay
those of the raw logits, and extreme values still give a valid token (no NaN)."""

from __future__ import annotations

import pytest
import torch

from models.sampler import Penalties, SamplingTensors, sample

VOCAB = 300


def penalties(rows: list[int], repetition: float = 1.0, presence: float = 0.0,
              frequency: float = 0.0, bias: tuple[tuple[int, float], ...] = ()) -> Penalties:
    n = len(rows)
    return Penalties.from_lists(rows, [presence] * n, [frequency] * n, [repetition] * n,
                                [list(range(0, VOCAB, 2))] * n, [[1, 1, 3]] * n, [bias] * n,
                                VOCAB, "cpu")


def test_only_penalised_rows_change_and_logprobs_stay_raw() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    plain = SamplingTensors.from_lists([0.0] * 4, [1.0] * 4, [-1] * 4, [None] * 4, "cpu")
    biased = SamplingTensors.from_lists([0.0] * 4, [1.0] * 4, [-1] * 4, [None] * 4, "cpu",
                                        penalties=penalties([1, 3], bias=((7, 100.0),)))
    a, b = sample(logits, plain), sample(logits, biased)
    assert b.token_ids.tolist() == [a.token_ids[0], 7, a.token_ids[2], 7]
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(b.logprobs, raw[torch.arange(4), b.token_ids])


@pytest.mark.parametrize("repetition", [5e-324, 1e-300, 1e-30, 1e30, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_extreme_penalties_still_give_a_valid_token(repetition: float,
                                                    temperature: float) -> None:
    logits = torch.randn(2, VOCAB) * 50
    st = SamplingTensors.from_lists([temperature] * 2, [0.9, 1.0], [-1, 5], [1, None], "cpu",
                                    penalties=penalties([0, 1], repetition, 2.0, -2.0,
                                                        ((5, -100.0), (6, 100.0))))
    out = sample(logits, st)
    assert ((0 <= out.token_ids) & (out.token_ids < VOCAB)).all()
    assert torch.isfinite(out.logprobs).all()


def test_token_ids_outside_the_vocab_are_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        Penalties.from_lists([0], [0.0], [0.0], [1.1], [[VOCAB]], [[]], [()], VOCAB, "cpu")
