"""Tests for models/sampler.py: greedy, temperature, top-k/top-p, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from models import cpu_argmax
from models.sampler import SamplingTensors, argmax, make_generator, sample

CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
CHI2_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def _settings(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
              seed: int | None = None, step: int = 0, device: str = "cpu") -> SamplingTensors:
    return SamplingTensors.from_lists(
        [temperature] * n, [top_p] * n, [top_k] * n, [seed] * n, device, step_offsets=[step] * n
    )


def _chi_square(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()  # [vocab_size]
    expected = probs.double() * token_ids.numel()  # [vocab_size]
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_rows_take_argmax_with_lowest_id_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)  # [num_seqs, vocab_size]
    logits[0, 7] = logits[0, 30] = 100.0
    result = sample(logits, _settings(6, temperature=0.0))
    assert result.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert result.token_ids[0].item() == 7


def test_greedy_rows_in_a_mixed_batch_still_take_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)  # [num_seqs, vocab_size]
    st = SamplingTensors.from_lists([0.0, 1.5, 0.0, 2.0], [1.0, 0.5, 0.3, 1.0], [-1, 3, 5, 0],
                                    [None, 5, 9, None], CPU)
    assert not st.is_all_greedy
    token_ids = sample(logits, st).token_ids
    assert token_ids[0].item() == logits[0].argmax().item()
    assert token_ids[2].item() == logits[2].argmax().item()


@pytest.mark.parametrize("setting", [{"top_k": 1}, {"top_p": 1e-6}])
def test_top_k_one_and_tiny_top_p_equal_greedy(setting: dict[str, float]) -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 300) * 0.1  # [num_seqs, vocab_size], nearly flat
    result = sample(logits, _settings(64, temperature=1.0, **setting))  # type: ignore[arg-type]
    assert result.token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_seeded", [False, True])
def test_temperature_sampling_matches_softmax(is_seeded: bool, device: str) -> None:
    torch.manual_seed(3)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2], device=device)  # [vocab]
    expected = torch.softmax(row / 0.7, dim=-1).cpu()  # [vocab_size]
    if is_seeded:  # one request drawing token after token from its own seed
        steps = [_settings(1, 0.7, seed=1234, step=s, device=device) for s in range(3000)]
        token_ids = torch.cat([sample(row.unsqueeze(0), st).token_ids for st in steps])
    else:
        token_ids = sample(row.expand(20000, -1), _settings(20000, 0.7, device=device)).token_ids
    assert _chi_square(token_ids.cpu(), expected) < CHI2_DF7_P001


def test_top_k_never_yields_a_token_outside_the_top_k() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2000, 100)  # [num_seqs, vocab_size]
    token_ids = sample(logits, _settings(2000, temperature=2.0, top_k=5)).token_ids
    top5 = logits.topk(5, dim=-1).indices  # [num_seqs, 5]
    assert bool((top5 == token_ids.unsqueeze(1)).any(dim=1).all())
    assert not bool((token_ids == logits.argmax(dim=-1)).all())  # it does sample


def test_top_p_keeps_the_smallest_nucleus_and_renormalises() -> None:
    torch.manual_seed(5)
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # [vocab_size]
    token_ids = sample(row.expand(20000, -1), _settings(20000, top_p=0.7)).token_ids
    counts = torch.bincount(token_ids, minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 20000 - 0.5 / 0.8) < 0.02


def test_top_p_applies_to_the_renormalised_top_k() -> None:
    torch.manual_seed(6)
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()  # [vocab_size]
    # top-k=2 leaves [4/7, 3/7]; the first alone already holds 0.57 >= 0.5
    token_ids = sample(row.expand(500, -1), _settings(500, top_p=0.5, top_k=2)).token_ids
    assert set(token_ids.tolist()) == {0}


def test_masked_tokens_are_never_sampled() -> None:
    torch.manual_seed(7)
    logits = torch.zeros(4000, 10)  # [num_seqs, vocab_size]
    logits[:, ::2] = float("-inf")
    token_ids = sample(logits, _settings(4000, temperature=1.0)).token_ids
    assert set(token_ids.tolist()) == {1, 3, 5, 7, 9}


def _seeded_row_in_batch(row: torch.Tensor, neighbours: torch.Tensor, position: int,
                         step: int) -> int:
    """Samples `row` (seed 42, top-p 0.9) placed at `position` among `neighbours`."""
    logits = torch.cat([neighbours[:position], row.unsqueeze(0), neighbours[position:]])
    n = logits.shape[0]
    # (temperature, top_p, top_k, seed) per neighbour: every path, seeds 42 included
    rows = [(0.9, 0.95, -1, None), (0.0, 1.0, 0, 3), (1.3, 0.99, -1, 42), (1.0, 0.5, 7, None),
            (0.6, 1.0, 40, 17), (1.0, 0.9, 0, 99), (0.8, 1.0, -1, None)][:n - 1]
    rows.insert(position, (0.8, 0.9, -1, 42))
    st = SamplingTensors.from_lists([r[0] for r in rows], [r[1] for r in rows],
                                    [r[2] for r in rows], [r[3] for r in rows], row.device,
                                    step_offsets=[step] * n)
    return int(sample(logits, st).token_ids[position])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_neighbours", "position"), [(0, 0), (1, 1), (3, 0), (6, 4),
                                                         (7, 7)])
def test_seeded_row_is_independent_of_batch_size_position_and_neighbours(
        num_neighbours: int, position: int, device: str) -> None:
    vocab_size = 3000
    torch.manual_seed(8)
    row = (torch.randn(vocab_size) * 3).to(device)  # [vocab_size] peaked: nucleus prefiltered
    empty = torch.empty(0, vocab_size, device=device)
    alone = [_seeded_row_in_batch(row, empty, 0, s) for s in range(12)]
    torch.manual_seed(100 + num_neighbours)  # flat neighbours force a whole-vocab sort
    neighbours = (torch.randn(num_neighbours, vocab_size) * 0.05).to(device)  # [n, vocab]
    in_batch = [_seeded_row_in_batch(row, neighbours, position, s) for s in range(12)]
    assert in_batch == alone
    assert len(set(alone)) > 3  # steps draw fresh tokens


def test_persistent_generators_give_the_same_tokens_in_any_batch() -> None:
    torch.manual_seed(9)
    logits = torch.randn(5, 400)  # [num_seqs, vocab_size]

    def run(rows: list[int]) -> list[int]:
        generator = make_generator(7, CPU)
        tokens = []
        for _ in range(10):
            n = len(rows)
            generators = [generator if r == 0 else None for r in rows]
            st = SamplingTensors.from_lists([1.0] * n, [1.0] * n, [-1] * n, [None] * n, CPU,
                                            generators=generators)
            tokens.append(int(sample(logits[rows], st).token_ids[rows.index(0)]))
        return tokens

    assert run([0]) == run([3, 1, 0, 4]) == run([0, 2])


def test_different_seeds_give_different_streams() -> None:
    torch.manual_seed(10)
    row = torch.randn(1, 1000)  # [1, vocab_size]
    streams = [[int(sample(row, _settings(1, seed=seed, step=s)).token_ids) for s in range(8)]
               for seed in (1, 2)]
    assert streams[0] != streams[1]


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    torch.manual_seed(11)
    logits = torch.randn(8, 500, dtype=torch.bfloat16)  # [num_seqs, vocab_size]
    st = SamplingTensors.from_lists([0.0, 0.5, 1.0, 2.0] * 2, [1.0, 0.9] * 4, [-1, 10] * 4,
                                    [None, 1] * 4, CPU)
    result = sample(logits, st)
    expected = torch.log_softmax(logits.float(), dim=-1).gather(
        1, result.token_ids.unsqueeze(1)).squeeze(1)  # [num_seqs]
    assert result.logprobs.dtype == torch.float32
    torch.testing.assert_close(result.logprobs, expected)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_only_in_the_rows_that_ask(greedy: bool) -> None:
    torch.manual_seed(12)
    logits = torch.randn(6, 300, dtype=torch.bfloat16)  # [num_seqs, vocab_size]
    wants = [False, True, False, False, True, False]
    st = SamplingTensors.from_lists([0.0 if greedy else 0.7] * 6, [1.0] * 6, [-1] * 6,
                                    [3] * 6, CPU, logprobs=wants)
    result = sample(logits, st)
    every = sample(logits, SamplingTensors.from_lists([0.0 if greedy else 0.7] * 6, [1.0] * 6,
                                                      [-1] * 6, [3] * 6, CPU))
    assert st.logprob_rows == (1, 4)
    assert torch.equal(result.token_ids, every.token_ids)
    assert torch.equal(result.logprobs, every.logprobs[[1, 4]])
    none = SamplingTensors.from_lists([0.0] * 6, [1.0] * 6, [-1] * 6, [None] * 6, CPU,
                                      logprobs=[False] * 6)
    assert sample(logits, none).logprobs.shape == (0,)


def test_greedy_bf16_logits_choose_as_their_float32_widening() -> None:
    torch.manual_seed(13)
    logits = torch.randn(16, 1000).to(torch.bfloat16)  # [num_seqs, vocab_size]
    logits[3, 10] = logits[3, 900] = logits[3].max() + 1  # a tie: the lowest id wins
    result = sample(logits, _settings(16, temperature=0.0))
    assert result.token_ids.tolist() == logits.float().argmax(dim=-1).tolist()
    assert result.token_ids[3].item() == 10


@pytest.mark.parametrize("vocab_size", [7, 256, 300, 50272])
@pytest.mark.parametrize("kernel", [True, False])  # models.cpu_argmax, or the torch blocks
def test_argmax_matches_torch_with_ties_nan_and_infinities(
        vocab_size: int, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel:
        monkeypatch.setattr(cpu_argmax, "argmax", lambda logits: None)
    torch.manual_seed(vocab_size)
    logits = torch.randn(9, vocab_size)  # [num_seqs, vocab_size]
    logits[7, -1] = logits[7, vocab_size // 2] = math.nan  # the first NaN, past a larger max
    logits[7, 0] = 60.0
    logits[1, :] = -math.inf
    logits[2, -1] = logits[2, 0] = 50.0  # a tie between the first block and the tail
    logits[3, vocab_size // 2] = math.nan
    logits[4, :] = 1.0
    logits[5, -1] = math.inf
    logits[6, vocab_size // 3] = logits[6, vocab_size - 1 - vocab_size // 3] = 9.0
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert argmax(logits.to(torch.bfloat16)).tolist() == logits.to(
        torch.bfloat16).argmax(dim=-1).tolist()


@pytest.mark.parametrize(("field", "lists"), [
    ("temperatures", ([-0.1], [1.0], [-1], [None])),
    ("temperatures", ([float("nan")], [1.0], [-1], [None])),
    ("top_ps", ([1.0], [0.0], [-1], [None])),
    ("top_ps", ([1.0], [1.5], [-1], [None])),
    ("top_ks", ([1.0], [1.0], [-2], [None])),
    ("seeds", ([1.0], [1.0], [-1], [None, None])),
])
def test_bad_settings_raise_value_error_naming_the_field(
        field: str, lists: tuple[list[float], list[float], list[int], list[int | None]]) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingTensors.from_lists(*lists, CPU)
