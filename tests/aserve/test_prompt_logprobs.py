"""Prompt logprobs (echo with logprobs) equal transformers' log-softmax over the same
checkpoint's logits (float64), whether the prompt is prefilled at once, in chunks, or shared
by n samples."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import OPTForCausalLM

from aserve import Engine, SamplingParams
from tests.aserve.test_engine import settle
from tests.conftest import make_config, make_prompts

PROMPTS = make_prompts(3, 20, 70, 512, seed=31)
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=True)


def hf_prompt_logprobs(checkpoint: Path, prompt: list[int]) -> list[float]:
    model = OPTForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float64).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]  # [len, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]  # position p predicts token p + 1
    return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("policy,max_prefill_tokens", [("aligned", 1024), ("continuous", 1024),
                                                       ("continuous", 16)],
                         ids=["prefill", "continuous", "chunked"])
async def test_prompt_logprobs_equal_transformers(policy: str, max_prefill_tokens: int,
                                                  tiny_checkpoint: Path) -> None:
    config = make_config(str(tiny_checkpoint), dtype="float64", policy=policy, min_requests=1,
                         max_prefill_tokens=max_prefill_tokens)
    async with Engine(config) as engine:
        outs = await asyncio.gather(*(engine.complete(p, PARAMS) for p in PROMPTS))
        plain = await engine.complete(PROMPTS[0], SamplingParams(max_tokens=3))
        await settle(engine)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_logprobs == pytest.approx(hf_prompt_logprobs(tiny_checkpoint, prompt),
                                                    abs=1e-5)
    assert plain.prompt_logprobs is None


async def test_forked_samples_carry_the_prompt_logprobs(tiny_checkpoint: Path) -> None:
    config = make_config(str(tiny_checkpoint), dtype="float64", min_requests=1)
    async with Engine(config) as engine:
        requests = [engine.make_request(PROMPTS[1], PARAMS, f"f{i}") for i in range(3)]
        finals = []
        for stream in engine.submit_samples(requests):
            async for out in stream:
                pass
            finals.append(out)
        await settle(engine)
    expected = hf_prompt_logprobs(tiny_checkpoint, PROMPTS[1])
    for out in finals:
        assert out.prompt_logprobs == pytest.approx(expected, abs=1e-5)
