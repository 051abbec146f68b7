"""The data objects that flow between actors: requests, sequences, states, events, outputs.

Imports no torch, asyncio or aiohttp: the first file a newcomer reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal, NewType

import msgspec

SeqId = NewType("SeqId", str)
MAX_INT64 = 2**63 - 1  # sampling values become torch int64 tensors


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request's tokens (the OpenAI completions fields)."""

    max_tokens: int = 16  # tokens to generate, >= 1
    min_tokens: int = 0  # EOS and stop strings are ignored before this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 or 0 disables; else keep the k most likely tokens
    seed: int | None = None  # per-request generator; same seed, same tokens
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not returned
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request
    ignore_eos: bool = False  # keep going past EOS (benchmarks force output lengths)
    logprobs: bool = False  # return the log-probability of each chosen token
    prompt_logprobs: bool = False  # return each prompt token's log-probability (echo)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each generated token
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: divides (multiplies if < 0) seen tokens' logits
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be in [0, max_tokens={self.max_tokens}]"
            )
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature ({self.temperature}) must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")
        if not -1 <= self.top_k <= MAX_INT64:
            raise ValueError(f"top_k ({self.top_k}) must be -1 (off) or in [0, {MAX_INT64}]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} ({value}) must be in [-2, 2]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty ({self.repetition_penalty}) must be a "
                             "finite number > 0")
        for token_id, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias ({bias} for token {token_id}) must be in "
                                 "[-100, 100]")

    @property
    def has_penalties(self) -> bool:
        """Any logit bias or penalty that changes the logits."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or (
            self.frequency_penalty != 0 or self.repetition_penalty != 1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """What the client asked for. Never mutated."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float  # perf_counter seconds


class SeqStatus(IntEnum):
    """Where a sequence is in its life. Finished states sort after the live ones.

    WAITING -> PREFILLING -> POOLED -> STAGED -> DECODING -> FINISHED_*
                                ^                   |
                                +---- (evicted) ----+
    The `continuous` policy skips POOLED and STAGED (prefill and decode share a device).
    """

    WAITING = 0  # queued for prefill
    PREFILLING = 1  # in a prefill step
    POOLED = 2  # KV in the host pool
    STAGED = 3  # KV in a staging buffer on the prefill device
    DECODING = 4  # KV in the decode cache, in the running batch
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= SeqStatus.FINISHED_STOPPED


FinishReason = Literal["stop", "length", "abort", "error"]

FINISH_REASONS: dict[SeqStatus, FinishReason] = {
    SeqStatus.FINISHED_STOPPED: "stop",
    SeqStatus.FINISHED_LENGTH: "length",
    SeqStatus.FINISHED_ABORTED: "abort",
    SeqStatus.FINISHED_ERROR: "error",
}

EventKind = Literal[
    "arrival",
    "prefill_start",
    "prefill_end",
    "pooled",
    "prefetched",
    "decode_start",
    "evicted",
    "first_token",
    "token",
    "finish",
]


@dataclass(frozen=True, slots=True)
class Event:
    """One lifecycle transition; the benchmark reads these and nothing else."""

    seq_id: str
    kind: EventKind
    time: float  # perf_counter seconds


@dataclass(slots=True)
class SeqState:
    """The engine's mutable state for one request; owned by exactly one actor at a time.

    token_ids:  | prompt ............ | output ...... |
                |<- num_prompt_tokens ->|
                |<---- num_computed_tokens ---->| (work left: num_tokens - computed)

    `location` names the KV store holding the KV ("prefill0", "host", "staging1", "decode1";
    "" when none); its block table is held by that store's allocator in transport/, keyed
    by seq_id (only transport writes block tables). `instance` is the decode instance the
    sequence was assigned to (-1 before), `batch_id` the candidate batch it came with.
    """

    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    location: str = ""
    status: SeqStatus = SeqStatus.WAITING
    instance: int = -1
    batch_id: int = -1
    num_returns: int = 0  # times a policy sent it back to the host pool mid-decode
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt tokens 1.. (if asked)
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    forks: list[SeqState] = field(default_factory=list)  # samples of this prompt (n > 1)
    # waiting for this sequence's prefill; they start from a copy of its KV

    @classmethod
    def from_request(cls, request: Request) -> SeqState:
        return cls(
            request=request,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
        )

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_cached_tokens(self) -> int:
        """KV entries that exist: every token but the newest sampled one."""
        return self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int, time: float, logprob: float | None = None) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(time)
        if logprob is not None:
            self.output_logprobs.append(logprob)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one sequence; streamed to the request's queue."""

    seq_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    time: float
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One decode (or mixed) iteration, or one packed prefill of a prefill instance, for
    research traces, the benchmark and the simulator's calibration."""

    instance: str  # e.g. "decode0"
    start_time: float  # perf_counter seconds when the forward step was issued
    batch_size: int
    num_prefill_tokens: int  # chunked-prefill tokens mixed in (continuous policy)
    min_len: int  # shortest prefix in the batch (tokens)
    max_len: int  # longest prefix in the batch (tokens)
    forward_time: float  # seconds
    schedule_time: float  # seconds the policy's decision took at the boundary before it
    is_mixed: bool  # requests of two batches (old and new) ran together
    blocks_used: dict[str, int]  # location -> blocks in use after the step
    lengths: tuple[int, ...] = ()  # each seq's prefix once the step is done, in batch order
    new_tokens: tuple[int, ...] = ()  # tokens each seq computed in the step (1: a decode)
    # ran in one forward with another instance's step (a CPU engine's prefill and decode):
    # forward_time is that whole forward's
    fused: bool = False


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One KV move between stores (prefetch, injection, eviction, offload)."""

    seq_id: str
    src: str  # store name, e.g. "host"
    dst: str  # store name, e.g. "staging0"
    num_blocks: int
    start_time: float  # perf_counter seconds, when the copy was issued
    end_time: float  # when it was complete


@dataclass(slots=True)
class RequestOutput:
    """The client's view of a request, yielded as tokens arrive."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    prompt_logprobs: list[float] | None = None  # of prompt tokens 1.. (token 0 has none)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
