"""n samples of one prompt share its prefill: the prompt is prefilled once, the other samples
start from a copy of its KV, and each sample equals the same request run on its own."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from aserve import Engine, SamplingParams
from aserve.engine.sequence import RequestOutput
from tests.aserve.test_engine import settle
from tests.conftest import make_config, make_prompts

PROMPT = make_prompts(1, 40, 40, 512, seed=21)[0]
PARAMS = SamplingParams(max_tokens=10, temperature=1.0, seed=100, ignore_eos=True)


def seeded(i: int) -> SamplingParams:
    return msgspec.structs.replace(PARAMS, seed=PARAMS.seed + i)  # type: ignore[operator]


async def run_samples(engine: Engine, n: int) -> list[RequestOutput]:
    requests = [engine.make_request(PROMPT, seeded(i), f"s{i}") for i in range(n)]
    outs = []
    for stream in engine.submit_samples(requests):
        outs.append(asyncio.ensure_future(_last(stream)))
    return list(await asyncio.gather(*outs))


async def _last(stream) -> RequestOutput:  # type: ignore[no-untyped-def]
    last = None
    async for last in stream:
        pass
    assert last is not None
    return last


def prefill_tokens(engine: Engine) -> int:
    """Prompt tokens whose KV was computed, over every prefill and mixed iteration."""
    return (sum(r.num_prefill_tokens for r in engine.prefill_iterations)
            + sum(r.num_prefill_tokens for r in engine.iterations))


@pytest.mark.parametrize("policy", ["aligned", "fcfs", "continuous"])
@pytest.mark.parametrize("num_prefill_blocks", [64, 4], ids=["fork", "no_room_to_fork"])
async def test_n_samples_prefill_once_and_equal_independent_requests(
        policy: str, num_prefill_blocks: int) -> None:
    config = make_config(policy=policy, min_requests=1, num_prefill_blocks=num_prefill_blocks,
                         num_decode_blocks=num_prefill_blocks)
    async with Engine(config) as engine:
        outs = await run_samples(engine, 4)
        num_shared = prefill_tokens(engine)
        await settle(engine)
        alone = [await engine.complete(PROMPT, seeded(i)) for i in range(4)]
        await settle(engine)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    if num_prefill_blocks == 64 and policy == "continuous":
        # one prefill of the prompt; each other sample recomputes only its last token,
        # mixed into a decode iteration
        assert num_shared == len(PROMPT) + 3
    elif num_prefill_blocks == 64:  # one packed prefill; the samples' last tokens in decode
        assert num_shared == len(PROMPT)
        assert [r.lengths for r in engine.prefill_iterations[:1]] == [(len(PROMPT),)]
    else:  # 40 tokens take 3 of the 4 blocks: no room for a copy, each is prefilled alone
        assert num_shared == 4 * len(PROMPT)


async def test_aborting_the_samples_before_prefill_frees_everything() -> None:
    async with Engine(make_config(policy="aligned", min_requests=1)) as engine:
        requests = [engine.make_request(PROMPT, seeded(i), f"a{i}") for i in range(4)]
        streams = engine.submit_samples(requests)
        for r in requests:
            engine.abort(r.request_id)
        outs = [await _last(s) for s in streams]
        await settle(engine)
    assert all(o.finish_reason in ("abort", "length") for o in outs)
