"""Cost model of one iteration (decode, prefill or mixed) and of KV transfers.

Roofline: time = overhead + max(bytes / bandwidth, FLOPs / rate), with the attention work
imbalance of the decode kernel added on top (docs/design.md §8: where the iteration-level
bubble is real).
Model geometries are a local table, so this never imports `models/` (which needs torch).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from scheduler.hardware import Hardware

KernelKind = Literal["split-k", "per-seq", "per-seq-lpt", "padded"]
KERNELS: tuple[KernelKind, ...] = ("split-k", "per-seq", "per-seq-lpt", "padded")
# the kernels whose decode step follows from its seqs' count, KV total and longest alone
# (``CostModel.decode_step_times``)
VECTORISED_KERNELS: tuple[KernelKind, ...] = ("split-k", "padded")


def kernel_kind(name: str) -> KernelKind:
    """`name` as a kernel kind (an attention backend's `kernel`); ValueError if unknown."""
    for kind in KERNELS:
        if kind == name:
            return kind
    raise ValueError(f"kernel ({name!r}) must be one of {KERNELS}")
NUM_POSITIONS = 2050  # OPT's learned position table (2048 + its offset of 2)


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The shapes that set a decoder's bytes and FLOPs (OPT's by default; the Llama family
    sets `num_kv_heads`, `gated_mlp`, no position table and its own LM head)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    ffn_dim: int
    vocab_size: int = 50272
    embed_dim: int = 0  # word_embed_proj_dim; 0 means hidden_size
    num_kv_heads: int = 0  # K/V heads (grouped-query attention); 0 means num_heads
    gated_mlp: bool = False  # three MLP matrices (gate, up, down) instead of two
    num_positions: int = NUM_POSITIONS  # rows of a learned position table (0: rotary)
    tied_embeddings: bool = True  # the LM head is the embedding table

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def proj_dim(self) -> int:
        return self.embed_dim or self.hidden_size

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (attention: q and o h^2 each, k and v
        h * kv_heads * head_dim each; MLP: 2 or 3 h ffn)."""
        h = self.hidden_size
        kv = self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + (3 if self.gated_mlp else 2) * h * self.ffn_dim

    @property
    def num_params(self) -> int:
        h, e = self.hidden_size, self.proj_dim
        proj = 2 * h * e if e != h else 0
        heads = 1 if self.tied_embeddings else 2  # embedding table, plus an untied LM head
        return (self.num_layers * self.layer_params + heads * self.vocab_size * e
                + self.num_positions * h + proj)

    @property
    def dense_flops_per_token(self) -> float:
        """Matmul FLOPs of every layer for one token, LM head excluded."""
        h, e = self.hidden_size, self.proj_dim
        return 2.0 * (self.num_layers * self.layer_params + (2 * h * e if e != h else 0))

    @property
    def lm_head_flops(self) -> float:
        """FLOPs of the LM head for one sampled token."""
        return 2.0 * self.proj_dim * self.vocab_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers (bytes): KV heads only."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes


GEOMETRIES: dict[str, ModelGeometry] = {
    g.name: g for g in (
        ModelGeometry("opt-tiny", 2, 64, 4, 256, vocab_size=512),
        ModelGeometry("opt-125m", 12, 768, 12, 3072),
        ModelGeometry("opt-350m", 24, 1024, 16, 4096, embed_dim=512),
        ModelGeometry("opt-1.3b", 24, 2048, 32, 8192),
        ModelGeometry("opt-2.7b", 32, 2560, 32, 10240),
        ModelGeometry("opt-6.7b", 32, 4096, 32, 16384),
        ModelGeometry("opt-13b", 40, 5120, 40, 20480),
        ModelGeometry("opt-30b", 48, 7168, 56, 28672),
        ModelGeometry("opt-66b", 64, 9216, 72, 36864),
        *(ModelGeometry(name, layers, hidden, heads, ffn, vocab_size=vocab, num_kv_heads=kv,
                        gated_mlp=True, num_positions=0, tied_embeddings=tied)
          for name, layers, hidden, heads, kv, ffn, vocab, tied in (
              ("llama-7b", 32, 4096, 32, 32, 11008, 32000, False),
              ("llama-13b", 40, 5120, 40, 40, 13824, 32000, False),
              ("llama3-8b", 32, 4096, 32, 8, 14336, 128256, False),
              ("smollm2-135m", 30, 576, 9, 3, 1536, 49152, True))),
    )
}


def get_geometry(name: str) -> ModelGeometry:
    """The geometry of the model `name` (OPT or Llama family). Raises ValueError if
    unknown."""
    geometry = GEOMETRIES.get(name.lower())
    if geometry is None:
        raise ValueError(f"model ({name!r}) must be one of {sorted(GEOMETRIES)}")
    return geometry


@dataclass(frozen=True, slots=True)
class CostParams:
    """The fitted constants (defaults: priors for a GPU serving stack, not measurements)."""

    step_overhead: float = 2e-3  # fixed time of every iteration: launches, host work (s)
    per_seq_overhead: float = 1e-5  # host work per sequence in the batch (s)
    bw_efficiency: float = 0.8  # achieved share of the nominal memory bandwidth
    flops_efficiency: float = 0.6  # achieved share of the nominal matmul rate
    imbalance_scale: float = 1.0  # weight of the attention imbalance term
    # Prompt tokens priced apart from the step's roofline, at their own share of the matmul
    # rate (None: inside it, at flops_efficiency). On the CPU a GEMM of a few decode rows
    # runs far below its rate at a prompt's hundreds.
    prefill_flops_efficiency: float | None = None
    # Prefill attention's time per FLOP beyond the matmuls' (0: both at the same rate; on
    # the CPU, one SDPA call per prompt runs far slower per FLOP than the GEMMs).
    attention_slowdown: float = 0.0

    @property
    def imbalance_weight(self) -> float:
        """The time one imbalance byte costs, in units of one byte's time at the nominal
        bandwidth (what a fit's imbalance column estimates)."""
        return self.imbalance_scale / self.bw_efficiency

    def __post_init__(self) -> None:
        for name in ("step_overhead", "per_seq_overhead", "imbalance_scale",
                     "attention_slowdown"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")
        for name in ("bw_efficiency", "flops_efficiency", "prefill_flops_efficiency"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be > 0")


class Features(NamedTuple):
    """What one iteration costs before the constants are applied (also the fit's inputs)."""

    num_seqs: int
    mem_bytes: float  # weights + KV read and written
    flops: float
    imbalance_bytes: float  # attention bytes priced apart (>= 0, ``imbalance_bytes``)
    prefill_flops: float = 0.0  # the FLOPs of prefill chunks' tokens (in flops)
    prefill_attention_flops: float = 0.0  # their query-key FLOPs (in prefill_flops)


class CostModel:
    """Iteration and transfer times for one model on one kind of device."""

    def __init__(self, geometry: ModelGeometry, hardware: Hardware,
                 params: CostParams | None = None, kernel: KernelKind = "split-k") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel ({kernel!r}) must be one of {KERNELS}")
        self.geometry, self.hardware, self.kernel = geometry, hardware, kernel
        self.params = params or CostParams()
        dtype = hardware.dtype_bytes
        self.weight_bytes = float(geometry.num_params * dtype)
        self.kv_bytes_per_token = geometry.kv_bytes_per_token(dtype)
        # Bytes of one (layer, head) slice of one token's K and V, summed over layers.
        self._head_bytes = 2 * geometry.head_dim * dtype * geometry.num_layers
        self._attn_flops = 4.0 * geometry.num_layers * geometry.hidden_size  # per query-key
        self._bw = hardware.memory_bandwidth * self.params.bw_efficiency
        self._rate = hardware.matmul_rate * self.params.flops_efficiency
        prefill_efficiency = self.params.prefill_flops_efficiency
        self._prefill_rate = (None if prefill_efficiency is None
                              else hardware.matmul_rate * prefill_efficiency)

    def features(self, decode_lengths: Sequence[int],
                 prefill_chunks: Sequence[tuple[int, int]] = ()) -> Features:
        """Bytes and FLOPs of one iteration.

        Args:
            decode_lengths: KV length (tokens, the new one included) of each decode seq.
            prefill_chunks: ``(num_computed, num_new)`` of each prefill (or chunk) seq.
        """
        decode_kv = sum(decode_lengths)
        num_kv, prefill_tokens, prefill_attn = decode_kv, 0, 0.0
        for start, num_new in prefill_chunks:
            num_kv += start + num_new
            prefill_tokens += num_new
            prefill_attn += num_new * start + num_new * (num_new + 1) / 2
        num_seqs = len(decode_lengths) + len(prefill_chunks)
        return self._features(num_seqs, len(decode_lengths), num_kv, float(decode_kv),
                              self.imbalance_bytes(decode_lengths), prefill_tokens, prefill_attn)

    def _features(self, num_seqs: int, num_decodes: int, num_kv: int, decode_attn: float,
                  imbalance: float, prefill_tokens: int = 0,
                  prefill_attn: float = 0.0) -> Features:
        """`Features` from the iteration's counts: seqs, decode tokens, KV tokens held,
        query-key pairs of decodes, imbalance bytes, and prefill chunks' tokens and
        query-key pairs (`features`, `GrowingDecodeStep`)."""
        g = self.geometry
        prefill_attention = self._attn_flops * prefill_attn
        prefill = g.dense_flops_per_token * prefill_tokens + prefill_attention
        flops = (g.dense_flops_per_token * num_decodes + g.lm_head_flops * num_seqs
                 + self._attn_flops * decode_attn + prefill)
        # the padded kernel's decode KV is priced by its rows (``imbalance_bytes``)
        held = num_kv - decode_attn if self.kernel == "padded" else num_kv
        return Features(num_seqs, self.weight_bytes + held * self.kv_bytes_per_token,
                        flops, imbalance, prefill, prefill_attention)

    def imbalance_bytes(self, lengths: Sequence[int]) -> float:
        """Decode attention priced apart from the roofline, as bytes at the full bandwidth:
        what imbalance costs a per-seq kernel, every row a padded one reads.

        `split-k` balances work over the SMs (0). `padded` reads every seq to the longest:
        all batch x longest rows are priced here, a seq's own as its padding, and its
        decode KV is left out of the roofline's bytes, since the kernel gathers and reads
        them alike (a fit that priced the own rows inside the roofline, at the weights'
        rate, put large uniform padded steps at half their time). `per-seq` gives each
        (seq, head) one SM; tasks run in waves of num_sms in batch order and each wave
        lasts as long as its longest sequence. `per-seq-lpt` is the same
        kernel with the sequences issued longest-first (see `wave_tokens`).
        """
        if not lengths or self.kernel == "split-k":
            return 0.0
        if self.kernel == "padded":
            return self._imbalance(len(lengths), sum(lengths), max(lengths), 0)
        heads, slots = self.geometry.num_heads, self.hardware.num_sms
        order = sorted(lengths, reverse=True) if self.kernel == "per-seq-lpt" else lengths
        return self._imbalance(len(lengths), sum(lengths), 0, wave_tokens(order, heads, slots))

    def lost_to_imbalance(self, lengths: Sequence[int]) -> float:
        """Seconds of a decode step over ``lengths`` lost to imbalance: the per-seq
        kernels' uneven waves, the padded kernel's padding rows (not the seqs' own, which
        ``imbalance_bytes`` prices too); 0 for split-K."""
        extra = self.imbalance_bytes(lengths)
        if self.kernel == "padded":
            extra -= sum(lengths) * self.kv_bytes_per_token
        return self.params.imbalance_scale * extra / self._bw

    def _imbalance(self, num_seqs: int, total: int, longest: int, waves: int) -> float:
        """`imbalance_bytes` of `num_seqs` decode seqs of `total` KV tokens, from their
        `longest` (padded) or their `wave_tokens` (per-seq kernels)."""
        if not num_seqs or self.kernel == "split-k":
            return 0.0
        if self.kernel == "padded":
            return float(num_seqs * longest) * self.kv_bytes_per_token
        return float(self.hardware.num_sms * waves
                     - self.geometry.num_heads * total) * self._head_bytes

    def time_of(self, f: Features) -> float:
        """Seconds for an iteration with features `f`."""
        p = self.params
        overheads = (p.step_overhead + p.per_seq_overhead * f.num_seqs
                     + p.imbalance_scale * f.imbalance_bytes / self._bw)
        if self._prefill_rate is None:  # prompt tokens inside the roofline
            return (overheads + max(f.mem_bytes / self._bw, f.flops / self._rate)
                    + p.attention_slowdown * f.prefill_attention_flops / self._rate)
        roof = max(f.mem_bytes / self._bw, (f.flops - f.prefill_flops) / self._rate)
        return (overheads + roof + (f.prefill_flops + p.attention_slowdown
                                    * f.prefill_attention_flops) / self._prefill_rate)

    def iteration_time(self, decode_lengths: Sequence[int],
                       prefill_chunks: Sequence[tuple[int, int]] = ()) -> float:
        """Seconds for one decode, prefill or mixed iteration (see `features`)."""
        return self.time_of(self.features(decode_lengths, prefill_chunks))

    def decode_step_times(self, num: np.ndarray, total: np.ndarray,
                          longest: np.ndarray) -> np.ndarray:
        """``iteration_time`` of decode steps of ``num`` seqs holding ``total`` KV tokens,
        the longest ``longest``, for many steps at once (padded and split-K kernels; the
        per-seq kernels' waves need each seq's length: ``ValueError``). Steps of no seqs
        take 0."""
        if self.kernel not in VECTORISED_KERNELS:
            raise ValueError(f"kernel ({self.kernel!r}) must be one of {VECTORISED_KERNELS}")
        g, p = self.geometry, self.params
        kvb = self.kv_bytes_per_token
        mem = self.weight_bytes + (0.0 if self.kernel == "padded" else total * kvb)
        flops = (g.dense_flops_per_token + g.lm_head_flops) * num + self._attn_flops * total
        imbalance = num * longest * kvb if self.kernel == "padded" else 0.0 * num
        times = (p.step_overhead + p.per_seq_overhead * num + p.imbalance_scale * imbalance
                 / self._bw + np.maximum(mem / self._bw, flops / self._rate))
        return np.where(num > 0, times, 0.0)

    def decode_step(self, lengths: Sequence[int]) -> GrowingDecodeStep:
        """The decode step over ``lengths`` as a batch that grows one seq at a time (a
        cost-aware policy tries candidates one by one: scheduler/step_time.py ``growing_step``)."""
        return GrowingDecodeStep(self, lengths)

    def prefill_time(self, prompt_lens: Sequence[int]) -> float:
        """Seconds for one packed prefill of whole prompts."""
        return self.iteration_time((), [(0, n) for n in prompt_lens])

    def kv_bytes(self, num_blocks: int, block_size: int) -> float:
        """Bytes of `num_blocks` KV blocks (whole blocks move)."""
        return float(num_blocks * block_size * self.kv_bytes_per_token)


class GrowingDecodeStep:
    """``CostModel.iteration_time`` of a decode step whose batch grows one seq at a time:
    ``time_with(length)`` (the step were ``length`` to join) in O(1) instead of a pass over
    the batch. It keeps the batch's count, sum and longest, and for the per-seq kernel its
    complete waves' tokens and the longest seq of its open (last, partial) wave: a seq
    joins at the end of the issue order, so it changes only the open wave and the new ones.

    The same numbers as ``iteration_time`` over the same lengths, to the last bit: the
    state is integers, and the time goes through the model's own ``_features``,
    ``_imbalance`` and ``time_of``, as ``iteration_time``'s does
    (tests/sim/test_growing_step.py). ``per-seq-lpt`` reorders the whole batch, so it
    recomputes.
    """

    def __init__(self, model: CostModel, lengths: Sequence[int]) -> None:
        self._model = model
        self._heads, self._slots = model.geometry.num_heads, model.hardware.num_sms
        self.lengths = list(lengths) if model.kernel == "per-seq-lpt" else None
        self.num_seqs, self.total, self.longest = len(lengths), sum(lengths), max(lengths,
                                                                                  default=0)
        self._done = self._open = 0  # per-seq: complete waves' tokens, open wave's longest
        if model.kernel == "per-seq" and lengths:
            num_tasks = self.num_seqs * self._heads
            if num_tasks % self._slots:
                self._open = max(lengths[num_tasks // self._slots * self._slots // self._heads:])
            self._done = wave_tokens(lengths, self._heads, self._slots) - self._open

    def time(self) -> float:
        """Seconds of the step over the batch as it stands."""
        kernel = self._model.kernel
        if kernel == "per-seq":
            return self._time(self.num_seqs, self.total, self._done + self._open, self.longest)
        if kernel == "per-seq-lpt":
            return self._model.iteration_time(self.lengths or ())
        return self._time(self.num_seqs, self.total, 0, self.longest)

    def time_with(self, length: int) -> float:
        """Seconds of the step were a seq of ``length`` tokens to join (nothing changes)."""
        if self.lengths is not None:  # per-seq-lpt
            return self._model.iteration_time([*self.lengths, length])
        waves = self._waves_with(length) if self._model.kernel == "per-seq" else 0
        return self._time(self.num_seqs + 1, self.total + length, waves,
                          max(self.longest, length))

    def add(self, length: int) -> None:
        """A seq of ``length`` tokens joins the batch (at the end of the issue order)."""
        if self.lengths is not None:
            self.lengths.append(length)
        elif self._model.kernel == "per-seq":
            waves = self._waves_with(length)
            num_tasks = self.num_seqs * self._heads
            end = num_tasks + self._heads
            if end % self._slots == 0:
                self._open = 0
            elif num_tasks % self._slots and (end - 1) // self._slots == num_tasks // self._slots:
                self._open = max(self._open, length)  # it only widens the open wave
            else:
                self._open = length  # the new open wave holds only this seq
            self._done = waves - self._open
        self.num_seqs += 1
        self.total += length
        self.longest = max(self.longest, length)

    def _waves_with(self, length: int) -> int:
        """``wave_tokens`` of the batch with a seq of ``length`` tokens at the end."""
        num_tasks = self.num_seqs * self._heads
        first, last = num_tasks // self._slots, (num_tasks + self._heads - 1) // self._slots
        if num_tasks % self._slots:  # it first fills the open wave, then its own
            return self._done + max(self._open, length) + length * (last - first)
        return self._done + length * (last - first + 1)

    def _time(self, num_seqs: int, total: int, waves: int, longest: int) -> float:
        """``time_of(features(lengths))`` from the lengths' count, sum, per-seq wave tokens
        and longest (one token computed per seq, each reading its whole KV)."""
        model = self._model
        imbalance = model._imbalance(num_seqs, total, longest, waves)
        return model.time_of(model._features(num_seqs, num_seqs, total, float(total),
                                             imbalance))

def wave_tokens(lengths: Sequence[int], heads: int, slots: int) -> int:
    """The per-seq kernel's wave model: tokens on the critical path of one layer's attention.

    Task i is (sequence i // heads, head i % heads), issued in this order; `slots` tasks
    (one per SM) run together as a wave, and a wave lasts as long as its longest sequence.
    What it assumes: one resident program per SM, and a barrier between waves (no SM starts
    a task of the next wave early). A GPU's block scheduler starts the next program as soon
    as any SM frees up (list scheduling), so the model is an upper bound whose error is
    largest in batch order; sorting longest-first makes each wave's tasks about equally
    long, where both schedules agree.
    """
    if not lengths:
        return 0
    firsts, lasts = _waves(len(lengths), heads, slots)
    # NOTE: a wave spans the sequences firsts[w]..lasts[w]; the next wave starts at
    # lasts[w] or lasts[w] + 1, so reduceat's segment [firsts[w], firsts[w + 1]) plus the
    # sequence lasts[w] is exactly the wave (reduceat gives firsts[w]'s alone when the next
    # wave starts on the same sequence). One vectorised pass: a cost-aware policy calls this
    # several times per decision.
    array = np.fromiter(lengths, dtype=np.int64, count=len(lengths))
    return int(np.maximum(np.maximum.reduceat(array, firsts), array[lasts]).sum())


@functools.lru_cache(maxsize=1024)
def _waves(num_seqs: int, heads: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The first and last sequence of each wave of ``num_seqs`` x ``heads`` tasks."""
    num_tasks = num_seqs * heads
    first_tasks = np.arange(0, num_tasks, slots)
    return first_tasks // heads, (np.minimum(first_tasks + slots, num_tasks) - 1) // heads
