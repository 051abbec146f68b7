"""Token sampling from a batch of logits: logit bias and penalties, then greedy, temperature,
top-k, top-p, per-row seeds.

Takes plain values and tensors, never requests. Seeded rows draw only from their own
generator, one draw per token, so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from models import cpu_argmax

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as vLLM)
ALL_TOKENS = -1  # SamplingTensors.num_ranked: rank the whole vocab
TOP_P_PREFILTER = 256  # tokens ranked first for rows with top-p but no top-k
CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF and argmax
LOGIT_LIMIT = 1e30  # penalised logits are clamped to +-this, so that / temperature stays finite
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling settings for one batch of logits (built by the engine's runner).

    `num_ranked` and `is_top_p_unbounded` are host-side summaries that let `sample` skip
    or shrink the top-k/top-p filter without reading the tensors back; `from_lists` sets
    them exactly, and the defaults are the safe (slow) choice.
    """

    temperatures: Tensor  # [num_seqs] float32, 0 = greedy
    top_ps: Tensor  # [num_seqs] float32 in (0, 1]
    top_ks: Tensor  # [num_seqs] long, 0 or -1 = off
    generators: list[torch.Generator | None]  # per row; None = use the global RNG
    is_all_greedy: bool  # fast path: a single argmax
    num_ranked: int = ALL_TOKENS  # top tokens per row the filter ranks; 0 = no filter
    is_top_p_unbounded: bool = True  # a row uses top-p without top-k: may rank the vocab
    penalties: Penalties | None = None  # logit bias and penalties of the rows that use them
    logprob_rows: tuple[int, ...] | None = None  # rows that want their logprob; None: all

    def __post_init__(self) -> None:
        num_seqs = self.temperatures.shape[0]
        for name in ("top_ps", "top_ks", "generators"):
            if len(getattr(self, name)) != num_seqs:
                raise ValueError(
                    f"len({name}) ({len(getattr(self, name))}) must equal "
                    f"len(temperatures) ({num_seqs})"
                )

    @classmethod
    def from_lists(
        cls,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        top_ks: Sequence[int],
        seeds: Sequence[int | None],
        device: torch.device | str,
        step_offsets: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        penalties: Penalties | None = None,
        logprobs: Sequence[bool] | None = None,
    ) -> SamplingTensors:
        """Validates per-row settings and builds the tensors on `device`.

        Row i draws from `generators[i]` when given (the engine keeps one per request),
        else from a generator seeded with `seeds[i]` -- mixed with `step_offsets[i]` (the
        request's output tokens so far) when given, so a stateless runner still gets a
        fresh, reproducible draw per token -- else from the global RNG. Greedy rows never
        draw, so they carry no generator. `logprobs[i]` says whether row i wants the chosen
        token's logprob (None: every row does).

        Raises:
            ValueError: a list length differs or a value is out of range.
        """
        num_seqs = len(temperatures)
        _check_lengths(num_seqs, top_ps=top_ps, top_ks=top_ks, seeds=seeds,
                       step_offsets=step_offsets, generators=generators, logprobs=logprobs)
        _check_values(temperatures, top_ps, top_ks, step_offsets)
        is_greedy = [t < SAMPLING_EPS for t in temperatures]
        row_generators = [
            None if is_greedy[i] else _row_generator(
                generators[i] if generators is not None else None, seeds[i],
                step_offsets[i] if step_offsets is not None else None, device)
            for i in range(num_seqs)
        ]
        sampled = [i for i in range(num_seqs) if not is_greedy[i]]
        ks = [top_ks[i] for i in sampled if top_ks[i] > 0]
        is_unbounded = any(top_ps[i] < 1 and top_ks[i] <= 0 for i in sampled)
        num_ranked = max(ks + [TOP_P_PREFILTER if is_unbounded else 0], default=0)
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.long, device=device),
            generators=row_generators,
            is_all_greedy=all(is_greedy),
            num_ranked=num_ranked,
            is_top_p_unbounded=is_unbounded,
            penalties=penalties,
            logprob_rows=None if logprobs is None else tuple(
                i for i, wants in enumerate(logprobs) if wants),
        )


@dataclass(frozen=True, slots=True)
class Penalties:
    """Logit bias and penalties for the rows of a batch that use any (the others skip them).

    Applied in vLLM's order: logit bias, then the repetition penalty over prompt and output
    tokens (transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided
    by the penalty when positive, multiplied when negative), then OpenAI's frequency and
    presence penalties over output tokens (logit -= frequency * count + presence * [count > 0]).

    Only the tokens a row has seen change, so they are held sparsely: one entry per distinct
    (row, token) of the prompts and outputs, and `apply` touches those entries alone.
    """

    rows: Tensor  # [num_rows] long: the batch rows these settings belong to
    bias: tuple[Tensor, Tensor, Tensor] | None  # (row, token id, bias) triples; None: no bias
    repetition: Tensor | None  # [num_rows] float32, 1 = off; None: off in every row
    presence: Tensor | None  # [num_rows] float32, 0 = off; None with frequency: both off
    frequency: Tensor | None  # [num_rows] float32, 0 = off
    seen_rows: Tensor  # [num_seen] long: the row (of `rows`) of each distinct seen token
    seen_ids: Tensor  # [num_seen] long: the token, in the prompt or the output
    output_counts: Tensor  # [num_seen] float32: times it was generated

    @classmethod
    def from_lists(
        cls,
        rows: Sequence[int],
        presence: Sequence[float],
        frequency: Sequence[float],
        repetition: Sequence[float],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        logit_biases: Sequence[Sequence[tuple[int, float]]],
        vocab_size: int,
        device: torch.device | str,
    ) -> Penalties:
        """Counts every row's tokens in a few tensor ops (no per-token loop); a kind that no
        row uses costs nothing in `apply`. `PenaltyCounts` keeps the counts between steps
        instead.

        Raises:
            ValueError: a list length differs, a penalty is out of range, or a token id is
                outside [0, vocab_size).
        """
        num_rows = len(rows)
        _check_lengths(num_rows, presence=presence, frequency=frequency,
                       repetition=repetition, prompt_ids=prompt_ids, output_ids=output_ids,
                       logit_biases=logit_biases)
        shape = (num_rows, vocab_size)
        prompt_rows, prompt_flat = _row_index(prompt_ids, shape, "cpu")
        output_rows, output_flat = _row_index(output_ids, shape, "cpu")
        keys = torch.cat([prompt_rows * vocab_size + prompt_flat,
                          output_rows * vocab_size + output_flat])  # [all tokens]
        distinct, inverse = torch.unique(keys, return_inverse=True)  # [num_seen], [all]
        counts = torch.zeros(len(distinct)).index_add_(
            0, inverse[len(prompt_flat):], torch.ones(len(output_flat)))  # [num_seen]
        return cls.from_seen(rows, presence, frequency, repetition, logit_biases, vocab_size,
                             distinct // vocab_size, distinct % vocab_size, counts, device)

    @classmethod
    def from_seen(
        cls,
        rows: Sequence[int],
        presence: Sequence[float],
        frequency: Sequence[float],
        repetition: Sequence[float],
        logit_biases: Sequence[Sequence[tuple[int, float]]],
        vocab_size: int,
        seen_rows: Tensor,
        seen_ids: Tensor,
        output_counts: Tensor,
        device: torch.device | str,
    ) -> Penalties:
        """From each row's distinct seen tokens (`seen_rows`, `seen_ids`, CPU, long) and their
        output counts (float32), already checked against the vocabulary.

        Raises:
            ValueError: a penalty is out of range, or a biased token id is outside
                [0, vocab_size).
        """
        for i, r in enumerate(repetition):
            if not (r > 0 and math.isfinite(r)):
                raise ValueError(f"repetition[{i}] ({r}) must be a finite number > 0")

        def floats(values: Sequence[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        bias = None
        if any(logit_biases):
            index = _row_index([[t for t, _ in pairs] for pairs in logit_biases],
                               (len(rows), vocab_size), device)
            bias = (*index, floats([v for pairs in logit_biases for _, v in pairs]))
        rep = pres = freq = None
        if any(r != 1 for r in repetition):
            # NOTE: a penalty below float32's smallest normal (e.g. 1e-300) would round to 0
            rep = floats(repetition).clamp(min=torch.finfo(torch.float32).tiny)
        if any(presence) or any(frequency):
            pres, freq = floats(presence), floats(frequency)
        if rep is None:
            # without the repetition penalty only generated tokens change (with presence or
            # frequency), or none
            keep = (output_counts > 0 if pres is not None
                    else torch.zeros_like(seen_ids, dtype=torch.bool))
            seen_rows, seen_ids = seen_rows[keep], seen_ids[keep]
            output_counts = output_counts[keep]
        return cls(rows=torch.tensor(rows, dtype=torch.long, device=device), bias=bias,
                   repetition=rep, presence=pres, frequency=freq,
                   seen_rows=seen_rows.to(device), seen_ids=seen_ids.to(device),
                   output_counts=output_counts.to(device))

    def apply(self, logits: Tensor) -> Tensor:
        """`logits` ([num_seqs, vocab_size] float32) with these rows biased and penalised."""
        out = logits.clone()  # [num_seqs, vocab_size]
        if self.bias is not None:
            rows, token_ids, values = self.bias
            out.index_put_((self.rows[rows], token_ids), values, accumulate=True)
        if len(self.seen_ids) and (self.repetition is not None or self.presence is not None):
            index = (self.rows[self.seen_rows], self.seen_ids)
            seen = out[index]  # [num_seen]
            if self.repetition is not None:
                rep = self.repetition[self.seen_rows]  # [num_seen]
                seen = torch.where(seen < 0, seen * rep, seen / rep)
            if self.presence is not None:
                assert self.frequency is not None, "presence and frequency are set together"
                counts = self.output_counts
                seen = seen - self.frequency[self.seen_rows] * counts
                seen = seen - self.presence[self.seen_rows] * (counts > 0)
            out.index_put_(index, seen)
        if len(self.rows) == len(out):  # every row (the rows are distinct)
            return out.clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)
        return out.index_copy_(0, self.rows,
                               out.index_select(0, self.rows).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT))


class PenaltyCounts:
    """Each sequence's distinct tokens and output counts, kept between steps: a step folds
    in only the tokens added since the last one, where rebuilding every row's counts from
    all of its tokens would cost as much as the step.

    A sequence is known by its token list (prompt then output, only ever appended to),
    which an entry holds on to; entries unused for `keep_calls` calls are dropped, and a
    sequence that comes back is counted afresh.
    """

    def __init__(self, vocab_size: int, device: torch.device | str,
                 keep_calls: int = 64) -> None:
        self.vocab_size, self.device, self.keep_calls = vocab_size, device, keep_calls
        self._entries: dict[int, _SeenTokens] = {}
        self._calls = 0

    def __len__(self) -> int:
        return len(self._entries)

    def penalties(
        self,
        rows: Sequence[int],
        presence: Sequence[float],
        frequency: Sequence[float],
        repetition: Sequence[float],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        logit_biases: Sequence[Sequence[tuple[int, float]]],
    ) -> Penalties:
        """The `Penalties` of these rows (as `Penalties.from_lists` over each row's prompt
        `token_ids[i][:num_prompt_tokens[i]]` and output, the rest of it).

        Raises:
            ValueError: a list length differs, a penalty is out of range, or a token id is
                outside [0, vocab_size).
        """
        _check_lengths(len(rows), presence=presence, frequency=frequency,
                       repetition=repetition, token_ids=token_ids,
                       num_prompt_tokens=num_prompt_tokens, logit_biases=logit_biases)
        self._calls += 1
        seen = [self._seen(ids, n) for ids, n in zip(token_ids, num_prompt_tokens)]
        if self._calls % self.keep_calls == 0:
            old = self._calls - self.keep_calls
            self._entries = {k: e for k, e in self._entries.items() if e.last_call > old}
        sizes = torch.tensor([e.size for e in seen], dtype=torch.long)  # [num_rows]
        seen_rows = torch.repeat_interleave(torch.arange(len(seen)), sizes)  # [num_seen]
        seen_ids = torch.cat([e.ids[:e.size] for e in seen]) if seen else sizes
        counts = (torch.cat([e.counts[:e.size] for e in seen]) if seen
                  else torch.zeros(0))  # [num_seen]
        return Penalties.from_seen(rows, presence, frequency, repetition, logit_biases,
                                   self.vocab_size, seen_rows, seen_ids, counts, self.device)

    def _seen(self, token_ids: Sequence[int], num_prompt_tokens: int) -> _SeenTokens:
        entry = self._entries.get(id(token_ids))
        if (entry is None or entry.token_ids is not token_ids
                or entry.num_prompt_tokens != num_prompt_tokens
                or entry.counted > len(token_ids)):
            entry = _SeenTokens(token_ids, num_prompt_tokens)
            self._entries[id(token_ids)] = entry
        entry.update(self.vocab_size)
        entry.last_call = self._calls
        return entry


class _SeenTokens:
    """One sequence's distinct tokens (first-seen order) and their output counts, in
    tensors that grow by doubling."""

    def __init__(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.token_ids = token_ids  # held: its id() keys the entry
        self.num_prompt_tokens = num_prompt_tokens
        self.counted = 0  # tokens folded in so far
        self.position: dict[int, int] = {}  # token id -> its index in `ids`
        self.ids = torch.empty(0, dtype=torch.long)  # [capacity]
        self.counts = torch.empty(0)  # [capacity] float32
        self.size = 0
        self.last_call = 0

    def update(self, vocab_size: int) -> None:
        """Folds in the tokens appended since the last call."""
        new = self.token_ids[self.counted:]
        if not new:
            return
        fresh: list[int] = []
        generated: list[int] = []  # index in `ids` of each new output token
        for j, t in enumerate(new, self.counted):
            at = self.position.get(t)
            if at is None:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab_size})")
                at = self.position[t] = self.size + len(fresh)
                fresh.append(t)
            if j >= self.num_prompt_tokens:
                generated.append(at)
        size = self.size + len(fresh)
        if size > len(self.ids):
            capacity = max(size, 2 * len(self.ids), 64)
            self.ids = torch.cat([self.ids[:self.size],
                                  torch.empty(capacity - self.size, dtype=torch.long)])
            self.counts = torch.cat([self.counts[:self.size], torch.zeros(capacity - self.size)])
        if fresh:
            self.ids[self.size:size] = torch.tensor(fresh, dtype=torch.long)
        if len(generated) == 1:
            self.counts[generated[0]] += 1
        elif generated:
            self.counts.index_add_(0, torch.tensor(generated), torch.ones(len(generated)))
        self.size, self.counted = size, len(self.token_ids)


def _row_index(ids: Sequence[Sequence[int]], shape: tuple[int, int],
               device: torch.device | str) -> tuple[Tensor, Tensor]:
    """(row, column) index tensors of every id of every row, checked against the vocab."""
    flat = torch.tensor([t for row in ids for t in row], dtype=torch.long)
    if len(flat) and not bool(((flat >= 0) & (flat < shape[1])).all()):
        bad = int(flat[(flat < 0) | (flat >= shape[1])][0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {shape[1]})")
    row_of = torch.repeat_interleave(torch.arange(shape[0]),
                                     torch.tensor([len(row) for row in ids], dtype=torch.long))
    return row_of.to(device), flat.to(device)


class SampleResult(NamedTuple):
    """Chosen tokens and their log-probabilities."""

    token_ids: Tensor  # [num_seqs] long
    logprobs: Tensor  # [num_logprob_rows] float32, log_softmax of the raw logits at the
    # chosen tokens of `SamplingTensors.logprob_rows` (of every row when that is None)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed` (any int; reduced modulo 2**64)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _MASK64)
    return generator


def step_seed(seed: int, step: int) -> int:
    """A 64-bit seed for token `step` of a request seeded with `seed` (splitmix64 mix)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def sample(logits: Tensor, st: SamplingTensors) -> SampleResult:
    """Chooses one token per row of `logits` ([num_seqs, vocab_size]) under `st`.

    Rows with `st.penalties` are biased and penalised first. Greedy rows take the argmax
    (ties -> lowest id). Other rows divide by their
    temperature, keep their top-k then top-p tokens, and draw by inverse CDF with one
    float64 uniform per row: seeded rows from their own generator, the rest in one
    batched draw from the global RNG.
    """
    if st.is_all_greedy and st.penalties is None:  # the argmax reads bf16 logits as they are
        token_ids = argmax(logits)  # [num_seqs]
        return SampleResult(token_ids, _chosen_logprobs(logits, token_ids, st.logprob_rows))
    raw = logits.float()  # [num_seqs, vocab_size]
    logits = raw if st.penalties is None else st.penalties.apply(raw)  # [num_seqs, vocab_size]
    greedy_ids = argmax(logits)  # [num_seqs]
    if st.is_all_greedy:
        token_ids = greedy_ids
    else:
        probs = _filtered_probs(logits, st)  # [num_seqs, vocab_size]
        sampled_ids = _inverse_cdf(probs, st.generators)  # [num_seqs]
        token_ids = torch.where(st.temperatures < SAMPLING_EPS, greedy_ids, sampled_ids)
    return SampleResult(token_ids, _chosen_logprobs(raw, token_ids, st.logprob_rows))


def argmax(logits: Tensor) -> Tensor:
    """`logits.argmax(dim=-1)` of a `[num_seqs, vocab_size]` tensor, ties and NaN alike.

    NOTE: torch's CPU argmax over a row is a scalar loop, several times slower than its
    vectorised max: the C kernel of `models.cpu_argmax` where it runs, else take the max of
    each block of CDF_BLOCK tokens, the first block holding the row's max, then the first
    token in that block that holds it.
    """
    if (token_ids := cpu_argmax.argmax(logits)) is not None:
        return token_ids
    num_seqs, vocab_size = logits.shape
    num_full = vocab_size // CDF_BLOCK
    block_max = logits[:, :num_full * CDF_BLOCK].unflatten(1, (num_full, CDF_BLOCK)).amax(-1)
    if vocab_size % CDF_BLOCK:
        tail = logits[:, num_full * CDF_BLOCK:].amax(dim=-1, keepdim=True)  # [num_seqs, 1]
        block_max = torch.cat([block_max, tail], dim=1)  # [num_seqs, num_blocks]
    block_ids = block_max.argmax(dim=-1)  # [num_seqs]
    offsets = torch.arange(CDF_BLOCK, device=logits.device)  # [CDF_BLOCK]
    token_ids = block_ids.unsqueeze(1) * CDF_BLOCK + offsets  # [num_seqs, CDF_BLOCK]
    inner = logits.gather(1, token_ids.clamp(max=vocab_size - 1))  # [num_seqs, CDF_BLOCK]
    inner = inner.masked_fill(token_ids >= vocab_size, -math.inf)
    return block_ids * CDF_BLOCK + inner.argmax(dim=-1)


def _chosen_logprobs(raw: Tensor, token_ids: Tensor, rows: tuple[int, ...] | None) -> Tensor:
    """log_softmax of `raw` ([num_seqs, vocab_size]) at `token_ids`, in the rows asked for
    (every row when `rows` is None); the others cost nothing."""
    if rows is not None and len(rows) < len(raw):
        index = torch.tensor(rows, dtype=torch.long, device=raw.device)  # [num_rows]
        raw, token_ids = raw.index_select(0, index), token_ids.index_select(0, index)
    logprobs = torch.log_softmax(raw.float(), dim=-1)  # [num_rows, vocab_size]
    return logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [num_rows]


def _filtered_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Temperature-scaled probabilities with tokens outside top-k/top-p zeroed (unnormalised)."""
    is_greedy = st.temperatures < SAMPLING_EPS  # [num_seqs]
    temps = torch.where(is_greedy, 1.0, st.temperatures)  # [num_seqs]
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)  # [num_seqs, vocab_size]
    if st.num_ranked == 0:
        return probs
    vocab_size = probs.shape[1]
    width = vocab_size if st.num_ranked == ALL_TOKENS else min(st.num_ranked, vocab_size)
    ranking = _rank(probs, st, width)
    if st.is_top_p_unbounded and width < vocab_size:
        if not bool((ranking.is_covered | is_greedy).all()):
            ranking = _rank(probs, st, vocab_size)
    cutoff = ranking.ranked.gather(1, (ranking.num_kept - 1).unsqueeze(1))  # [num_seqs, 1]
    is_unfiltered = (st.top_ks <= 0) & (st.top_ps >= 1)  # [num_seqs]
    cutoff = cutoff.masked_fill(is_unfiltered.unsqueeze(1), 0.0)
    return probs.masked_fill(probs < cutoff, 0.0)


class _Ranking(NamedTuple):
    ranked: Tensor  # [num_seqs, width] the top `width` probabilities, descending
    num_kept: Tensor  # [num_seqs] long, how many of them the row keeps (>= 1)
    is_covered: Tensor  # [num_seqs] bool, the kept set is decided within `width`


def _rank(probs: Tensor, st: SamplingTensors, width: int) -> _Ranking:
    """Ranks the top `width` tokens per row and counts those top-k then top-p keep.

    A row is covered when it uses top-k, has no top-p, or its ranked mass already reaches
    top-p. The mass is a prefix sum over the ranked tokens, so a row keeps the same tokens
    whatever `width` its batch needed.
    """
    if width >= probs.shape[1]:
        ranked = probs.sort(dim=-1, descending=True).values  # [num_seqs, vocab_size]
    else:
        ranked = probs.topk(width, dim=-1).values  # [num_seqs, width]
    has_top_k = st.top_ks > 0  # [num_seqs]
    k = torch.where(has_top_k, st.top_ks.clamp(max=width), width)  # [num_seqs]
    mass = ranked.cumsum(dim=-1)  # [num_seqs, width]
    kept_mass = torch.where(has_top_k, mass.gather(1, (k - 1).unsqueeze(1)).squeeze(1), 1.0)
    top_p = torch.where(st.top_ps < 1, st.top_ps, 2.0)  # [num_seqs]
    positions = torch.arange(width, device=probs.device)  # [width]
    is_kept = positions < k.unsqueeze(1)  # [num_seqs, width]
    is_kept &= (mass - ranked) < (top_p * kept_mass).unsqueeze(1)
    is_covered = has_top_k | (st.top_ps >= 1) | (mass[:, -1] >= top_p * kept_mass)
    # NOTE: a top_p below float32's smallest subnormal rounds to 0 and would keep nothing;
    # the most likely token is always kept.
    return _Ranking(ranked, is_kept.sum(dim=-1).clamp(min=1), is_covered)


def _inverse_cdf(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """One token per row, drawn with probability proportional to `probs` ([num_seqs, V]).

    NOTE: two levels give float64 precision at float32 cost (a float64 cumsum over the
    vocab costs as much as the LM head on a CPU): pick a block of CDF_BLOCK tokens by the
    CDF of block masses, then a token in it, reusing the uniform's fraction within the block.
    """
    vocab_size = probs.shape[1]
    u = _uniforms(probs.shape[0], generators, probs.device)  # [num_seqs] in [0, 1)
    block_ids, fraction = _search(_block_masses(probs), u)  # [num_seqs], [num_seqs]
    offsets = torch.arange(CDF_BLOCK, device=probs.device)  # [CDF_BLOCK]
    token_ids = block_ids.unsqueeze(1) * CDF_BLOCK + offsets  # [num_seqs, CDF_BLOCK]
    inner = probs.gather(1, token_ids.clamp(max=vocab_size - 1))  # [num_seqs, CDF_BLOCK]
    inner = inner.masked_fill(token_ids >= vocab_size, 0.0).double()
    inner_ids, _ = _search(inner, fraction)  # [num_seqs]
    return token_ids.gather(1, inner_ids.unsqueeze(1)).squeeze(1)


def _uniforms(num_seqs: int, generators: list[torch.Generator | None],
              device: torch.device) -> Tensor:
    """One float64 uniform per row: seeded rows from their own generator, the rest batched."""
    u = torch.rand(num_seqs, dtype=torch.float64, device=device)  # [num_seqs]
    seeded_rows = [i for i, g in enumerate(generators) if g is not None]
    if seeded_rows:
        draws = [torch.rand(1, dtype=torch.float64, device=device, generator=g)
                 for g in generators if g is not None]
        rows = torch.tensor(seeded_rows, device=device)  # [num_seeded]
        u[rows] = torch.cat(draws)  # [num_seeded]
    return u


def _block_masses(probs: Tensor) -> Tensor:
    """[num_seqs, ceil(V / CDF_BLOCK)] float64: the mass of each block of CDF_BLOCK tokens."""
    num_full = probs.shape[1] // CDF_BLOCK
    full = probs[:, :num_full * CDF_BLOCK].unflatten(1, (num_full, CDF_BLOCK))
    masses = full.sum(dim=-1)  # [num_seqs, num_full]
    if probs.shape[1] % CDF_BLOCK:
        tail = probs[:, num_full * CDF_BLOCK:].sum(dim=-1, keepdim=True)  # [num_seqs, 1]
        masses = torch.cat([masses, tail], dim=1)
    return masses.double()


def _search(mass: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse CDF over `mass` ([num_seqs, m] float64, each row > 0) at `u` ([num_seqs]).

    Returns the chosen column (never one of zero mass) and where `u` fell inside it, as a
    fraction in [0, 1) that is itself uniform, for a second level of search.
    """
    cdf = mass.cumsum(dim=-1)  # [num_seqs, m]
    total = cdf[:, -1:]  # [num_seqs, 1]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True)  # [num_seqs, 1]
    before = torch.where(ids > 0, cdf.gather(1, (ids - 1).clamp(min=0)), 0.0)  # [num_seqs, 1]
    fraction = (target - before) / mass.gather(1, ids)  # [num_seqs, 1]
    return ids.squeeze(1), fraction.squeeze(1).clamp(0.0, 1.0)


def _row_generator(given: torch.Generator | None, seed: int | None, step: int | None,
                   device: torch.device | str) -> torch.Generator | None:
    if given is not None or seed is None:
        return given
    return make_generator(seed if step is None else step_seed(seed, step), device)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _check_lengths(num_seqs: int, **lists: Sequence[object] | None) -> None:
    for name, values in lists.items():
        if values is not None and len(values) != num_seqs:
            raise ValueError(
                f"len({name}) ({len(values)}) must equal len(temperatures) ({num_seqs})"
            )


def _check_values(
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    step_offsets: Sequence[int] | None,
) -> None:
    for i, (t, p, k) in enumerate(zip(temperatures, top_ps, top_ks)):
        if not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"temperatures[{i}] ({t}) must be a finite number >= 0")
        if not 0 < p <= 1:
            raise ValueError(f"top_ps[{i}] ({p}) must be in (0, 1]")
        if k < -1:
            raise ValueError(f"top_ks[{i}] ({k}) must be -1 or 0 (off) or >= 1")
    for i, step in enumerate(step_offsets or ()):
        if step < 0:
            raise ValueError(f"step_offsets[{i}] ({step}) must be >= 0")
