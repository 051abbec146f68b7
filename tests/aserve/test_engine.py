"""The engine end to end on the CPU: exact outputs against transformers, aborts, capacity
pressure, injected faults and input validation. Every scenario ends with integrity checks."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from pathlib import Path

import pytest

from aserve import Engine, SamplingParams
from aserve.engine.sequence import RequestOutput
from scheduler import POLICIES as REGISTERED
from tests.conftest import make_config, make_prompts

POLICIES = sorted(REGISTERED)  # every registered policy


async def collect(engine: Engine, prompt: list[int] | str, params: SamplingParams,
                  request_id: str | None = None) -> RequestOutput:
    return await engine.complete(prompt, params, request_id)


async def settle(engine: Engine, timeout: float = 5.0) -> None:
    """Waits until every KV block on every location is free again."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.stats()["live"] or any(used for used, _ in engine.stats()["kv"].values()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"KV blocks still in use: {engine.stats()['kv']}")
        await asyncio.sleep(0.01)
    engine.check_integrity()


def hf_greedy(checkpoint: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    import torch
    from transformers import OPTForCausalLM

    model = OPTForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float64).eval()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
            outs.append(gen[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module")
def greedy_case(tiny_checkpoint: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    prompts = make_prompts(16, 1, 300, 512, seed=1)
    rng = random.Random(2)
    max_tokens = [rng.randint(1, 64) for _ in prompts]
    return prompts, max_tokens, hf_greedy(tiny_checkpoint, prompts, max_tokens)


@pytest.mark.parametrize("policy", POLICIES)
async def test_greedy_outputs_match_transformers(policy: str, tiny_checkpoint: Path,
                                                 greedy_case) -> None:  # type: ignore[no-untyped-def]
    prompts, max_tokens, expected = greedy_case
    config = make_config(str(tiny_checkpoint), dtype="float64", policy=policy,
                         num_decode_blocks=64, min_requests=2)
    async with Engine(config) as engine:
        outs = await asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, max_tokens)))
        await settle(engine)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("policy", ["fcfs", "continuous", "aligned", "aligned-loose"])
async def test_aborted_requests_free_every_block(policy: str) -> None:
    rng = random.Random(3)
    prompts = make_prompts(200, 1, 120, 512, seed=4)
    config = make_config(policy=policy, num_decode_blocks=128, num_staging_blocks=64)
    async with Engine(config) as engine:
        async def one(i: int, prompt: list[int]) -> tuple[bool, RequestOutput | None]:
            params = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True)
            task = asyncio.ensure_future(collect(engine, prompt, params, f"r{i}"))
            if i % 10 < 3:  # 30 % are aborted at a random moment
                await asyncio.sleep(rng.random() * 0.3)
                engine.abort(f"r{i}")
                out = await task
                return False, out
            return True, await task

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        for i, (kept, out) in enumerate(results):
            assert out is not None and out.finished
            if kept:
                assert out.finish_reason == "length", out
            else:
                assert out.finish_reason in ("abort", "length")
        for (kept, out) in results:
            if kept and out is not None:
                assert len(out.token_ids) >= 1
        await settle(engine)


@pytest.mark.parametrize("policy", ["fcfs", "aligned", "continuous", "aligned-loose"])
async def test_small_decode_cache_forces_evictions_and_all_complete(policy: str) -> None:
    prompts = make_prompts(24, 40, 100, 512, seed=5)
    config = make_config(policy=policy, num_decode_blocks=24, num_staging_blocks=32)
    async with Engine(config) as engine:
        outs = await asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in prompts))
        evictions = sum(1 for e in engine.events if e.kind == "evicted")
        await settle(engine)
    assert all(len(o.token_ids) == 60 for o in outs)
    assert evictions > 0


async def test_tail_swaps_keep_every_seqs_kv_intact(tiny_checkpoint: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`aligned` on paged attention swaps stalled seqs in for running ones in a backlog's
    tail (scheduler/aligned.py, ``_swap``): each swap moves KV out and back in, and the
    greedy outputs still match transformers."""
    from scheduler import aligned

    swaps: list[object] = []
    swap = aligned.AlignedPolicy._swap

    def counted(self, view, waited):  # type: ignore[no-untyped-def]
        plan = swap(self, view, waited)
        if plan.evict:
            swaps.append(plan)
        return plan

    monkeypatch.setattr(aligned.AlignedPolicy, "_swap", counted)
    prompts = make_prompts(12, 20, 120, 512, seed=8)
    max_tokens = [48] * len(prompts)
    config = make_config(str(tiny_checkpoint), dtype="float64", policy="aligned",
                         attention="paged", num_decode_blocks=24, num_staging_blocks=64,
                         min_requests=2)
    async with Engine(config) as engine:
        outs = await asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, max_tokens)))
        await settle(engine)
    assert swaps, "the small decode cache leaves evicted seqs stalled in the tail"
    assert [o.token_ids for o in outs] == hf_greedy(tiny_checkpoint, prompts, max_tokens)


async def test_small_host_pool_makes_prefill_wait_and_all_complete() -> None:
    prompts = make_prompts(40, 50, 120, 512, seed=6)
    # float32 tiny blocks are 16 KiB: ~24 blocks of host pool, far less than 40 prompts need
    config = make_config(policy="aligned", host_pool_gb=24 * 16384 / 2**30,
                         num_decode_blocks=64)
    async with Engine(config) as engine:
        outs = await asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts))
        peak_host = max(r.blocks_used["host"] for r in engine.iterations)
        await settle(engine)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert peak_host <= 24


async def test_prefill_instances_record_each_packed_prefill() -> None:
    prompts = make_prompts(12, 20, 90, 512, seed=7)
    config = make_config(policy="fcfs", max_prefill_tokens=256)
    async with Engine(config) as engine:
        await asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts))
        records = list(engine.prefill_iterations)
        await settle(engine)
    assert sorted(n for r in records for n in r.lengths) == sorted(map(len, prompts))
    for r in records:
        assert r.instance == "prefill0" and r.num_prefill_tokens <= 256
        assert r.new_tokens == r.lengths  # whole prompts, from an empty prefix
        assert r.num_prefill_tokens == sum(r.lengths) and r.forward_time > 0
        assert r.batch_size == len(r.lengths)


async def test_serving_objects_are_out_of_full_collections_while_the_engine_runs() -> None:
    """What start-up leaves alive is frozen (no full collection walks it inside a forward);
    after stop the collector sees it again, and a cycle made while serving is collected."""
    config = make_config(policy="fcfs")
    async with Engine(config) as engine:
        assert gc.get_freeze_count() > 0
        ref = weakref.ref(_Node())  # a reference cycle made while serving
        await collect(engine, [5, 6, 7], SamplingParams(max_tokens=2))
        gc.collect()
        assert ref() is None
    assert gc.get_freeze_count() == 0


class _Node:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("policy", ["fcfs", "continuous"])
async def test_runner_fault_fails_affected_requests_and_engine_keeps_serving(policy: str) -> None:
    config = make_config(policy=policy)
    async with Engine(config) as engine:
        runner = next(iter(engine.ctx.runners.values()))  # type: ignore[union-attr]
        calls = {"n": 0}

        def fail_steps_3_to_5() -> None:  # a failed decode step runs once more: fail it too
            calls["n"] += 1
            if 3 <= calls["n"] <= 5:
                raise RuntimeError("injected forward failure")

        runner.fault_hook = fail_steps_3_to_5
        prompts = make_prompts(6, 5, 30, 512, seed=7)
        outs = await asyncio.wait_for(asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=12, ignore_eos=True))
            for p in prompts)), timeout=30)
        errors = [o for o in outs if o.finish_reason == "error"]
        assert errors and all("injected forward failure" in (o.error or "") for o in errors)
        runner.fault_hook = None
        after = await asyncio.wait_for(
            collect(engine, prompts[0], SamplingParams(max_tokens=5, ignore_eos=True)), 30)
        assert after.finish_reason == "length" and len(after.token_ids) == 5
        assert engine.health()["healthy"]
        await settle(engine)


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt"),
    ("", SamplingParams(), "prompt"),
    ([5, 600], SamplingParams(), "token id"),
    ([-1], SamplingParams(), "token id"),
    ([5] * 2000, SamplingParams(max_tokens=100), "context"),
])
async def test_bad_input_raises_before_allocating(prompt: list[int] | str,
                                                  params: SamplingParams, field: str) -> None:
    async with Engine(make_config(max_position_embeddings=2048)) as engine:
        with pytest.raises(ValueError, match=field):
            await collect(engine, prompt, params)
        assert engine.stats()["running"] == 0
        await settle(engine)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


async def test_stop_string_ends_request_and_frees_blocks() -> None:
    async with Engine(make_config(policy="aligned")) as engine:
        free_run = await collect(engine, "hello", SamplingParams(max_tokens=24, temperature=0,
                                                                 ignore_eos=True))
        text = free_run.text
        stop = next(text[i:i + 2] for i in range(2, len(text) - 1)
                    if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2])
        out = await collect(engine, "hello", SamplingParams(max_tokens=24, temperature=0,
                                                            ignore_eos=True, stop=(stop,)))
        assert out.finish_reason == "stop"
        assert stop not in out.text and free_run.text.startswith(out.text)
        await settle(engine)


@pytest.mark.parametrize("policy", ["aligned", "fcfs"])
async def test_request_above_the_batch_share_is_still_served(policy: str) -> None:
    # 40 blocks of decode KV, batches may take half: a 30-block request must still run
    config = make_config(policy=policy, num_decode_blocks=40, batch_kv_fraction=0.5)
    long_prompt = make_prompts(1, 400, 400, 512, seed=8)[0]
    shorts = make_prompts(6, 10, 30, 512, seed=9)
    async with Engine(config) as engine:
        outs = await asyncio.wait_for(asyncio.gather(*(
            collect(engine, p, SamplingParams(max_tokens=16, ignore_eos=True))
            for p in [long_prompt, *shorts])), timeout=60)
        await settle(engine)
    assert all(len(o.token_ids) == 16 for o in outs)
