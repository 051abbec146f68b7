"""Offline batches: `LLM`, shaped as vLLM's (`LLM(model=...).generate(prompts, params)`), which
keeps one engine loaded between calls, and `aserve.generate` through a short-lived engine."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from aserve.cluster import engine_for
from aserve.engine.config import EngineConfig
from aserve.engine.engine import Engine
from aserve.engine.sequence import RequestOutput, SamplingParams

T = TypeVar("T")
Prompts = str | Sequence[str | list[int]]  # one text, or texts and token-id lists


class LLM:
    """An engine for offline batches, loaded once: `LLM(model="opt-125m", policy="aligned",
    dtype="bfloat16").generate(prompts, SamplingParams(max_tokens=32))`.

    Keywords are `EngineConfig`'s flat keywords, vLLM's names included (`tokenizer`, `seed`,
    `block_size`, `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`,
    `enforce_eager`); see the README's table. Use as a context manager or call `close()`.
    """

    def __init__(self, model: str = "opt-125m", **kwargs: object) -> None:
        self.config = EngineConfig.create(model=model, **kwargs)
        self._loop = _new_loop()
        self._engine = engine_for(self.config)
        try:
            self._loop.run_until_complete(self._engine.start())
        except BaseException:
            self._loop.close()
            raise

    def generate(self, prompts: Prompts,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion, batched by the engine's policy; returns the
        outputs in prompt order. `sampling_params` is one for all prompts or one per prompt.

        Raises:
            ValueError: bad input (a prompt too long, a params list of the wrong length).
        """
        if self._loop.is_closed():
            raise ValueError("this LLM is closed")
        items: list[str | list[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        per_prompt = _per_prompt(sampling_params, len(items))
        return self._loop.run_until_complete(_complete_all(self._engine, items, per_prompt))

    def close(self) -> None:
        """Stops the engine and frees its memory; later `generate` calls raise."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._engine.stop())
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def generate(prompts: Sequence[str | list[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             config: EngineConfig | None = None) -> list[RequestOutput]:
    """Runs every prompt to completion; results come back in prompt order.

    `params` is one SamplingParams for all prompts or one per prompt.
    """
    per_prompt = _per_prompt(params, len(prompts))
    return run(_generate_all(list(prompts), per_prompt, config))


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                num_prompts: int) -> list[SamplingParams]:
    params = params or SamplingParams()
    per_prompt = [params] * num_prompts if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != num_prompts:
        raise ValueError(f"params has {len(per_prompt)} entries for {num_prompts} prompts")
    return per_prompt


async def _complete_all(engine: Engine, prompts: list[str | list[int]],
                        params: list[SamplingParams]) -> list[RequestOutput]:
    return list(await asyncio.gather(*(engine.complete(pr, p)
                                       for pr, p in zip(prompts, params))))


async def _generate_all(prompts: list[str | list[int]], params: list[SamplingParams],
                        config: EngineConfig | None) -> list[RequestOutput]:
    async with engine_for(config or EngineConfig()) as engine:
        return await _complete_all(engine, prompts, params)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
