"""Penalties in the batched sampler: only the rows that ask for them change, logprobs stay
those of the raw logits, and extreme values still give a valid token (no NaN)."""

from __future__ import annotations

import pytest
import torch

from models.sampler import Penalties, PenaltyCounts, SamplingTensors, sample

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


def dense_reference(logits: torch.Tensor, rows: list[int], presence: float, frequency: float,
                    repetition: float, prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """The penalties over whole [rows, vocab] tensors, one formula per token."""
    out = logits.clone()
    for row, prompt, output in zip(rows, prompts, outputs):
        x = out[row]
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[prompt + output] = True
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
        if repetition != 1:
            x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        out[row] = x
    return out


@pytest.mark.parametrize("repetition,presence,frequency", [
    (1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (0.8, -0.4, 1.5)])
def test_counts_kept_between_steps_match_a_rebuild_and_the_dense_formula(
        repetition: float, presence: float, frequency: float) -> None:
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 1)]
    prompt_lens = [len(s) for s in sequences]
    kept = PenaltyCounts(VOCAB, "cpu", keep_calls=3)
    rows = [0, 2, 3]
    for step in range(8):
        if step == 5:
            sequences[1] = list(sequences[1])  # a new list: counted afresh
        n = len(rows)
        args = (rows, [presence] * n, [frequency] * n, [repetition] * n)
        prompts = [s[:p] for s, p in zip(sequences, prompt_lens)]
        outputs = [s[p:] for s, p in zip(sequences, prompt_lens)]
        logits = torch.randn(4, VOCAB, generator=gen)
        want = dense_reference(logits, rows, presence, frequency, repetition, prompts, outputs)
        rebuilt = Penalties.from_lists(*args, prompts, outputs, [()] * n, VOCAB, "cpu")
        incremental = kept.penalties(*args, sequences, prompt_lens, [()] * n)
        assert torch.equal(rebuilt.apply(logits), want)
        assert torch.equal(incremental.apply(logits), want)
        for s in sequences:  # each sequence generates one (often repeated) token
            s.append(s[-1] if step % 2 else int(torch.randint(VOCAB, (1,), generator=gen)))
    for _ in range(4):  # only the first sequence goes on: the others' entries are dropped
        kept.penalties([0], [presence], [frequency], [repetition], sequences[:1],
                       prompt_lens[:1], [()])
    assert len(kept) == 1


def test_kept_counts_refuse_token_ids_outside_the_vocab() -> None:
    kept = PenaltyCounts(VOCAB, "cpu")
    with pytest.raises(ValueError, match="vocabulary"):
        kept.penalties([0], [0.0], [0.5], [1.0], [[1, VOCAB]], [1], [()])
