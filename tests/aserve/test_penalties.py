"""Logit bias and penalties end to end: the engine's tokens equal transformers' `generate`
(float64, same checkpoint) under transformers' own logits processors, greedy and seeded.

transformers has processors for the repetition penalty (RepetitionPenaltyLogitsProcessor)
and for a logit bias (SequenceBiasLogitsProcessor with one-token sequences). It has none for
OpenAI's presence and frequency penalties, so `PresenceFrequency` below applies OpenAI's
documented formula to transformers' scores. Seeded sampling is reproduced by `SeededDraw`, a
processor that draws the engine's documented uniform for (seed, step) by a float64 inverse
CDF and leaves only the drawn token, so greedy `generate` takes it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    OPTForCausalLM,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from aserve import Engine, SamplingParams
from models.sampler import make_generator, step_seed
from tests.aserve.test_engine import settle
from tests.conftest import make_config, make_prompts

MAX_TOKENS = 24


class PresenceFrequency(LogitsProcessor):
    """OpenAI: logit[t] -= frequency * count[t] + presence * (count[t] > 0), over the
    generated tokens only."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.num_prompt_tokens, self.presence, self.frequency = (num_prompt_tokens, presence,
                                                                 frequency)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        output = input_ids[:, self.num_prompt_tokens:]  # [1, num_output]
        counts = torch.zeros_like(scores).scatter_add_(
            1, output, torch.ones_like(output, dtype=scores.dtype))  # [1, vocab]
        return scores - self.frequency * counts - self.presence * (counts > 0)


class SeededDraw(LogitsProcessor):
    """Draws token `step` of a request seeded with `seed` as the engine documents it: one
    float64 uniform from a generator seeded with step_seed(seed, step), inverse CDF."""

    def __init__(self, num_prompt_tokens: int, seed: int) -> None:
        self.num_prompt_tokens, self.seed = num_prompt_tokens, seed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.num_prompt_tokens
        generator = make_generator(step_seed(self.seed, step), "cpu")
        u = torch.rand(1, dtype=torch.float64, generator=generator)
        cdf = torch.softmax(scores[0].double(), dim=-1).cumsum(dim=-1)  # [vocab]
        token_id = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(cdf) - 1))
        out = torch.full_like(scores, -torch.inf)
        out[0, token_id] = 0.0
        return out


def processors(params: SamplingParams, num_prompt_tokens: int) -> LogitsProcessorList:
    """transformers' processors for `params`, in the engine's (vLLM's) order."""
    out = LogitsProcessorList()
    if params.logit_bias:
        out.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        out.append(PresenceFrequency(num_prompt_tokens, params.presence_penalty,
                                     params.frequency_penalty))
    if params.temperature > 0:
        assert params.seed is not None, "the reference reproduces seeded draws only"
        out.append(TemperatureLogitsWarper(params.temperature))
        out.append(SeededDraw(num_prompt_tokens, params.seed))
    return out


def hf_tokens(model: OPTForCausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    # NOTE: no EOS rather than min_new_tokens: its processor would mask EOS out of the
    # distribution, while the engine's ignore_eos keeps EOS drawable and only ignores it.
    config = GenerationConfig(max_new_tokens=params.max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=1, bos_token_id=2)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=processors(params, len(prompt)))
    return gen[0, len(prompt):].tolist()  # type: ignore[no-any-return]


def penalised(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


# Large penalties so that they change the tokens of a random tiny model (checked below).
SETTINGS = {
    "greedy": penalised(temperature=0),
    "repetition_1.1": penalised(temperature=0, repetition_penalty=1.1),
    "repetition_3": penalised(temperature=0, repetition_penalty=3.0),
    "repetition_0.5": penalised(temperature=0, repetition_penalty=0.5),
    "presence_2": penalised(temperature=0, presence_penalty=2.0),
    "frequency_0.5": penalised(temperature=0, frequency_penalty=0.5),
    "frequency_-1": penalised(temperature=0, frequency_penalty=-1.0),
    "logit_bias": penalised(temperature=0, logit_bias=((7, 100.0), (9, 5.0), (11, -100.0))),
    "all": penalised(temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                     repetition_penalty=1.3, logit_bias=((20, 2.0),)),
    "seeded_repetition": penalised(temperature=0.8, seed=3, repetition_penalty=2.0),
    "seeded_presence_frequency": penalised(temperature=1.0, seed=4, presence_penalty=1.5,
                                           frequency_penalty=1.0),
    "seeded_all": penalised(temperature=0.7, seed=5, presence_penalty=0.5,
                            frequency_penalty=0.5, repetition_penalty=1.1,
                            logit_bias=((30, 3.0), (31, -3.0))),
    "seeded_neutral": penalised(temperature=1.0, seed=6),
}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> dict[str, list[list[int]]]:
    model = OPTForCausalLM.from_pretrained(tiny_checkpoint, torch_dtype=torch.float64).eval()
    return {name: [hf_tokens(model, p, params) for p in PROMPTS]
            for name, params in SETTINGS.items()}


PROMPTS = make_prompts(3, 5, 40, 512, seed=11)


@pytest.mark.parametrize("policy", ["continuous", "aligned"])
async def test_penalised_tokens_equal_transformers_processors(
        policy: str, tiny_checkpoint: Path, reference: dict[str, list[list[int]]]) -> None:
    config = make_config(str(tiny_checkpoint), dtype="float64", policy=policy, min_requests=2)
    names = list(SETTINGS)
    async with Engine(config) as engine:  # every setting and prompt in one mixed batch
        outs = await asyncio.gather(*(engine.complete(p, SETTINGS[name])
                                      for name in names for p in PROMPTS))
        await settle(engine)
    got = {name: [o.token_ids for o in outs[i * len(PROMPTS):(i + 1) * len(PROMPTS)]]
           for i, name in enumerate(names)}
    assert got == reference


def test_the_settings_change_the_tokens(reference: dict[str, list[list[int]]]) -> None:
    """The comparison above is not vacuous: each penalty changes transformers' output."""
    for name in ("repetition_3", "presence_2", "frequency_0.5", "logit_bias", "all"):
        assert reference[name] != reference["greedy"], name
    assert reference["seeded_all"] != reference["seeded_neutral"]
    assert all(7 in tokens for tokens in reference["logit_bias"])
    assert not any(11 in tokens for tokens in reference["logit_bias"])
