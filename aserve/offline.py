"""`aserve.generate`: a synchronous offline batch through a short-lived engine."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aserve.config import EngineConfig
from aserve.core import RequestOutput, SamplingParams
from aserve.engine import Engine


def generate(prompts: Sequence[str | list[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             config: EngineConfig | None = None) -> list[RequestOutput]:
    """Runs every prompt to completion; results come back in prompt order.

    `params` is one SamplingParams for all prompts or one per prompt.
    """
    params = params or SamplingParams()
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"params has {len(per_prompt)} entries for {len(prompts)} prompts")
    return run(_generate_all(list(prompts), per_prompt, config))


async def _generate_all(prompts: list[str | list[int]], params: list[SamplingParams],
                        config: EngineConfig | None) -> list[RequestOutput]:
    async with Engine(config) as engine:
        return list(await asyncio.gather(*(engine.complete(pr, p)
                                           for pr, p in zip(prompts, params))))


def run(coro):  # type: ignore[no-untyped-def]
    """Runs a coroutine on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
