"""ModelRunner: turns a step's work into tensors, runs forward and sampling on one device.

All blocking torch work (forward, sampling, `.tolist()`) happens here, in the device's single
worker thread; actors reach it only through the awaitable `ModelRunner.execute`.
It makes no scheduling decisions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

import aserve
from aserve.engine.config import ModelConfig
from aserve.engine.cuda_graphs import DecodeGraphs
from aserve.engine.host import tune_host_allocator
from models import cpu_bf16_gemm, cpu_isa
from models.attention import AttentionMetadata, get_backend
from models.loader import load_model
from models.opt import HalfLinear, OPTConfig, OPTForCausalLM, fit_matmuls_to
from models.sampler import Penalties, PenaltyCounts, SamplingTensors, sample
from transport.blocks import PAD_BLOCK_ID

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROW_GRANULE = 16  # a CPU prompt step's rows are a multiple of this (`_row_padding`)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One sequence's share of a step: compute tokens [start, start + len(token_ids))."""

    token_ids: list[int]  # the tokens whose KV this step computes
    start: int  # position of the first of them (= tokens already cached)
    block_table: list[int]  # covers start + len(token_ids) tokens
    do_sample: bool  # the last token is the sequence's newest: sample the next one
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    step: int  # output tokens so far; seeded draws depend on (seed, step) only
    penalties: PenaltySettings | None = None  # logit bias and penalties; None = neutral
    prompt_logprobs: PromptLogprobs | None = None  # where to write prompt logprobs, if asked
    logprobs: bool = False  # return the sampled token's logprob (costs a pass over the vocab)


@dataclass(frozen=True, slots=True)
class PenaltySettings:
    """A sequence's logit bias and penalties, and the tokens they count."""

    presence: float
    frequency: float
    repetition: float
    logit_bias: tuple[tuple[int, float], ...]
    token_ids: Sequence[int]  # prompt then output (the sequence's list, not copied)
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A sequence's prompt-logprob list, which a step computing prompt tokens fills in:
    out[p] is log P(token p + 1 | tokens 0..p). Written by position, so a recompute after
    preemption overwrites rather than appends."""

    token_ids: Sequence[int]  # the sequence's tokens (its list, not copied)
    num_prompt_tokens: int
    out: list[float]  # the sequence's prompt_logprobs (written in the worker thread)


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens, aligned with the work items that asked for one (None elsewhere)."""

    token_ids: list[int | None]
    logprobs: list[float | None]
    forward_time: float  # seconds of forward + sampling, measured in the worker thread
    fused: bool = False  # ran in one forward with another instance's step (actors.StepQueue)


class ModelRunner:
    """The model on one device and that device's worker thread.

    `fault_hook` is a test hook: when set, it is called at the start of every step and may
    raise to simulate a failing forward pass.
    """

    def __init__(self, config: ModelConfig, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        # NOTE: all of the device's torch work (loading, prepacking, steps, CPU copies) runs
        # in this one thread. Every thread that opens an OpenMP parallel region keeps a team
        # of threads until it exits, and GNU OpenMP stops spinning idle threads (aserve's
        # default, aserve/__init__.py) while its teams' threads outnumber the cores.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"aserve-{device}")
        try:
            self.executor.submit(self._load, config, device).result()
        except BaseException:
            self.executor.shutdown(wait=False)
            raise
        self.fault_hook: Callable[[], None] | None = None

    def _load(self, config: ModelConfig, device: torch.device) -> None:
        self.model: OPTForCausalLM
        self.model_config: OPTConfig
        self.model, self.model_config = load_model(
            config.model, config.dtype, device, seed=config.weights_seed,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.model.eval()
        if device.type == "cpu":
            tune_host_allocator()  # as the engine does: steps run the same outside it
        # NOTE: prepacked float32 matmuls on CPUs: torch's bf16/fp16 GEMM without AVX-512
        # BF16 or AMX runs several times slower than float32 (docs/results.md).
        packed = fit_matmuls_to(self.model, device)
        if device.type == "cpu":
            halves = [m for m in self.model.modules() if isinstance(m, HalfLinear)]
            kernel = "AMX tiles" if cpu_bf16_gemm.has_tiles() else "AVX-512 BF16"
            decode = (f" (decode rows on {kernel})" if any(m.has_decode_kernel for m in halves)
                      else "")
            logger.info("CPU: %s; %s model: linear layers in %s; %d threads, idle ones: %s",
                        cpu_isa.describe(), config.dtype, "prepacked float32" if packed else
                        f"prepacked {config.dtype}{decode}" if halves else config.dtype,
                        torch.get_num_threads(), aserve.OPENMP_WAITS)
        self.backend = get_backend(config.attention)
        # float64 runs on the CPU are the reference: their GEMMs stay over the real rows
        self.pads_rows = device.type == "cpu" and next(
            self.model.parameters()).dtype != torch.float64
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and config.cuda_graphs:
            max_blocks = -(-self.model_config.max_position_embeddings // self.block_size)
            self.graphs = DecodeGraphs(self.model, self.backend, self.block_size, max_blocks)
        # each sequence's penalty counts, kept between steps (touched in the worker thread only)
        self.penalty_counts = PenaltyCounts(self.model_config.vocab_size, device)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Runs `fn(*args)` in this device's worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)

    async def execute(self, items: list[WorkItem], kv_cache: torch.Tensor) -> StepResult:
        """Runs one step (prefill, decode or mixed) over `items` against `kv_cache`."""
        return await self.call(self.execute_sync, items, kv_cache)

    @torch.inference_mode()
    def execute_sync(self, items: list[WorkItem], kv_cache: torch.Tensor) -> StepResult:
        start_time = time.perf_counter()
        if self.fault_hook is not None:
            self.fault_hook()
        input_ids, positions, meta = self._prepare(items)
        try:
            hidden = None if self.graphs is None else self.graphs.forward(
                input_ids, positions, kv_cache, meta)  # None: not a graph-able decode step
            if hidden is None:
                hidden = self.model(input_ids, positions, kv_cache, meta, self.backend)
        finally:
            if meta.num_seqs > len(items):  # row padding wrote the null block: zeros again
                kv_cache[PAD_BLOCK_ID].zero_()
        self._prompt_logprobs(items, hidden, meta)
        sample_rows = [i for i, item in enumerate(items) if item.do_sample]
        token_ids: list[int | None] = [None] * len(items)
        logprobs: list[float | None] = [None] * len(items)
        if sample_rows:
            ends = meta.query_start_loc[1:] - 1  # [num_seqs] last token of each sequence
            index = ends[torch.tensor(sample_rows, device=self.device)]  # [num_sample]
            logits = self.model.compute_logits(hidden[index])  # [num_sample, vocab]
            chosen = [items[i] for i in sample_rows]
            st = SamplingTensors.from_lists(
                [c.temperature for c in chosen], [c.top_p for c in chosen],
                [c.top_k for c in chosen], [c.seed for c in chosen], self.device,
                step_offsets=[c.step for c in chosen], penalties=self._penalties(chosen),
                logprobs=[c.logprobs for c in chosen],
            )
            result = sample(logits, st)
            for row, tok in zip(sample_rows, result.token_ids.tolist()):
                token_ids[row] = tok
            assert st.logprob_rows is not None, "the runner names the rows that want logprobs"
            for j, lp in zip(st.logprob_rows, result.logprobs.tolist()):
                logprobs[sample_rows[j]] = lp
        return StepResult(token_ids, logprobs, time.perf_counter() - start_time)

    def _prompt_logprobs(self, items: list[WorkItem], hidden: torch.Tensor,
                         meta: AttentionMetadata) -> None:
        """Fills the prompt logprobs of the items that ask for them and compute prompt tokens
        (those whose next token is a prompt token)."""
        if all(item.prompt_logprobs is None for item in items):
            return
        starts = meta.query_start_loc.tolist()
        for i, item in enumerate(items):
            pl = item.prompt_logprobs
            end = min(item.start + len(item.token_ids), pl.num_prompt_tokens - 1) if pl else 0
            if pl is None or end <= item.start:
                continue
            rows = hidden[starts[i]:starts[i] + end - item.start]  # [n, d]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            next_ids = torch.tensor(pl.token_ids[item.start + 1:end + 1], device=self.device)
            chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)  # [n]
            pl.out[item.start:end] = chosen.tolist()

    def _penalties(self, chosen: list[WorkItem]) -> Penalties | None:
        """The penalty tensors of the rows that have any; None when no row has."""
        rows = [i for i, c in enumerate(chosen) if c.penalties is not None]
        if not rows:
            return None
        ps = [p for c in chosen if (p := c.penalties) is not None]
        return self.penalty_counts.penalties(
            rows, [p.presence for p in ps], [p.frequency for p in ps],
            [p.repetition for p in ps], [p.token_ids for p in ps],
            [p.num_prompt_tokens for p in ps], [p.logit_bias for p in ps])

    def _prepare(self, items: list[WorkItem]) -> tuple[torch.Tensor, torch.Tensor,
                                                       AttentionMetadata]:
        flat_ids: list[int] = []
        flat_pos: list[int] = []
        for item in items:
            flat_ids.extend(item.token_ids)
            flat_pos.extend(range(item.start, item.start + len(item.token_ids)))
        query_lens = [len(item.token_ids) for item in items]
        seq_lens = [item.start + len(item.token_ids) for item in items]
        tables = [item.block_table for item in items]
        pad = self._row_padding(query_lens)
        if pad:  # a sequence of its own, in the null block, after every real one
            flat_ids.extend([0] * pad)
            flat_pos.extend(range(pad))
            query_lens.append(pad)
            seq_lens.append(pad)
            tables.append([PAD_BLOCK_ID] * -(-pad // self.block_size))
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)  # [T]
        positions = torch.tensor(flat_pos, dtype=torch.long, device=self.device)  # [T]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size,
                                       self.device)
        return input_ids, positions, meta

    def _row_padding(self, query_lens: list[int]) -> int:
        """Tokens to add to a CPU step that carries prompt tokens, so that its row count is
        a multiple of `ROW_GRANULE`.

        NOTE: oneDNN builds a GEMM primitive for each row count it meets (milliseconds per
        weight at prompt sizes; docs/results-cpu.md) and keeps a bounded number of them
        (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`): prompt steps, each of its own length, paid a
        build at every weight shape. Rounded up, a process meets one row count per
        `ROW_GRANULE` tokens and builds each once; the rows added (a null sequence in block
        `PAD_BLOCK_ID`, which nothing samples and `execute_sync` zeroes again) cost less
        than a build. Decode steps (one token per sequence) keep their rows."""
        if not self.pads_rows or all(n == 1 for n in query_lens):
            return 0
        rows = sum(query_lens)
        return -rows % ROW_GRANULE if rows > ROW_GRANULE else 0

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
