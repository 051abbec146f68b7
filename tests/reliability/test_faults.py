"""Injected faults: the model runner raising mid-iteration, a KV copy failing, the host pool
refusing an allocation, an actor dying. The affected requests end with finish_reason="error"
and a message, the others complete, the engine keeps serving with every block accounted for,
and a dead actor makes /health answer 503 (and new requests 503) instead of hanging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from aserve import Engine, SamplingParams
from aserve.cores import Move
from aserve.engine.config import ServerConfig
from aserve.engine.sequence import RequestOutput, SeqState
from aserve.entrypoints.server import ENGINE, create_app
from tests.aserve.test_engine import collect, settle
from tests.conftest import make_config, make_prompts
from tests.reliability.conftest import BlockLedger, Gate, is_decode, is_prefill, wait_for_event

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = make_prompts(4, 8, 40, 512, seed=11)


class ActorCrash(BaseException):
    """Escapes an actor's `except Exception` boundary: its task dies."""


def start(engine: Engine, request_id: str, prompt: list[int],
          params: SamplingParams = PARAMS) -> asyncio.Task[RequestOutput]:
    return asyncio.ensure_future(collect(engine, prompt, params, request_id))


async def finish_all(engine: Engine, tasks: dict[str, asyncio.Task[RequestOutput]],
                     ledger: BlockLedger) -> dict[str, RequestOutput]:
    """Waits for every request and for every block to be free, then checks the books and
    that the engine still serves a new request."""
    outs = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 30)))
    after = await asyncio.wait_for(collect(engine, PROMPTS[0], PARAMS, "after"), 30)
    assert after.finish_reason == "length" and len(after.token_ids) == PARAMS.max_tokens
    await settle(engine)
    assert ledger.unbalanced() == {}
    assert engine.health()["healthy"]
    return outs


def assert_only_victims_failed(outs: dict[str, RequestOutput], victims: set[str],
                               message: str, params: SamplingParams = PARAMS) -> None:
    for request_id, out in outs.items():
        if request_id in victims:
            assert out.finish_reason == "error" and message in (out.error or ""), out
        else:
            assert out.finish_reason == "length", out
            assert len(out.token_ids) == params.max_tokens


@pytest.mark.parametrize("num_failures", [1, 2], ids=["once", "twice"])
@pytest.mark.parametrize("policy", ["aligned", "fcfs", "continuous"])
async def test_runner_raising_mid_iteration_fails_only_that_batch(policy: str,
                                                                  num_failures: int) -> None:
    """A decode step that fails once runs again (its KV is intact) and every request
    completes; one that fails twice fails its batch alone. (Steps apart: the gate parks
    the decode step while the prompts are prefilled.)"""
    async with Engine(make_config(policy=policy, fuse_steps=False)) as engine:
        ledger = BlockLedger(engine)
        runner = next(iter(engine.ctx.runners.values()))  # type: ignore[union-attr]
        gate = Gate(runner, "execute", is_decode)
        tasks = {"victim": start(engine, "victim", PROMPTS[0])}
        await gate.entered.wait()  # "victim" alone in the running batch, held mid-iteration
        tasks |= {f"other{i}": start(engine, f"other{i}", p) for i, p in enumerate(PROMPTS[1:])}
        if engine.ctx.policy.uses_pool:  # type: ignore[union-attr]
            for i in range(len(PROMPTS) - 1):
                await wait_for_event(engine, f"other{i}", "pooled")

        failures = iter(range(num_failures - 1, -1, -1))

        def fail() -> None:
            if next(failures) == 0:
                runner.fault_hook = None
            raise RuntimeError("injected forward failure")

        runner.fault_hook = fail
        gate.open()
        outs = await finish_all(engine, tasks, ledger)
    victims = {"victim"} if num_failures > 1 else set()
    assert_only_victims_failed(outs, victims, "injected forward failure")


async def test_a_fused_forward_failing_fails_what_ran_in_it_and_nothing_else() -> None:
    """A prefill and a decode step fused into one forward, which fails once: the decode
    batch runs again and completes (its KV is intact), the prompts in the forward end with
    the error, the others complete, every block is freed once and the engine serves on."""
    async with Engine(make_config(policy="aligned")) as engine:
        ledger = BlockLedger(engine)
        runner = next(iter(engine.ctx.runners.values()))  # type: ignore[union-attr]
        steps = next(iter(engine.ctx.steps.values()))  # type: ignore[union-attr]
        gate = Gate(runner, "execute", is_decode)
        tasks = {"victim": start(engine, "victim", PROMPTS[0])}
        await gate.entered.wait()  # "victim" decodes; its step holds the device
        tasks |= {f"other{i}": start(engine, f"other{i}", p) for i, p in enumerate(PROMPTS[1:])}
        while not steps.waiting:  # the prompts' prefill waits for the device
            await asyncio.sleep(0.001)
        gated = runner.execute
        fused_items: list[list[int]] = []

        async def fail_fused_once(items: list, kv_cache: object) -> object:  # type: ignore[type-arg]
            if not fused_items and is_prefill(items) and not all(i.start == 0 for i in items):
                fused_items.append([len(i.token_ids) for i in items])
                raise RuntimeError("injected fused failure")
            return await gated(items, kv_cache)

        runner.execute = fail_fused_once
        gate.open()
        outs = await finish_all(engine, tasks, ledger)
    assert fused_items and steps.num_fused >= 1
    failed = {rid for rid, out in outs.items() if out.finish_reason == "error"}
    assert failed and "victim" not in failed
    assert_only_victims_failed(outs, failed, "injected fused failure")


Inject = Callable[[SeqState, str], None]


def fail_first_move(engine: Engine, path: tuple[str, str], inject: Inject,
                    when: str = "copy") -> list[str]:
    """Wraps `kv.copy` (or `kv.reserve`, for `when="reserve"`) so that `inject` arms a fault
    for the first move from a store named `path[0]*` to one named `path[1]*`; returns the
    list that receives the victim's id."""
    kv = engine.ctx.kv  # type: ignore[union-attr]
    original = getattr(kv, when)
    victims: list[str] = []

    def arm(seq: SeqState, dst_name: str) -> None:
        if seq.location.startswith(path[0]) and dst_name.startswith(path[1]) and not victims:
            victims.append(seq.seq_id)
            inject(seq, dst_name)

    def reserve(seq: SeqState, dst_name: str, *parent: SeqState) -> object:
        arm(seq, dst_name)
        return original(seq, dst_name, *parent)

    async def copy(move: Move, clock: object) -> None:
        arm(move.seq, move.dst)
        await original(move, clock)

    setattr(kv, when, reserve if when == "reserve" else copy)
    return victims


async def run_with_fault(path: tuple[str, str], make_inject: Callable[[Engine], Inject],
                         message: str, max_tokens: int = PARAMS.max_tokens,
                         when: str = "copy", **config: object) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with Engine(make_config(policy="aligned", **config)) as engine:
        ledger = BlockLedger(engine)
        victims = fail_first_move(engine, path, make_inject(engine), when)
        tasks = {f"r{i}": start(engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS)}
        outs = await finish_all(engine, tasks, ledger)
    assert len(victims) == 1
    assert_only_victims_failed(outs, set(victims), message, params)


def copy_fault(engine: Engine) -> Inject:
    kv = engine.ctx.kv  # type: ignore[union-attr]

    def inject(seq: SeqState, dst_name: str) -> None:
        # NOTE: on the CPU every store shares one copy engine; copies run in order on the
        # thread that `Copier.executor` names, so arming it there, right before this move's
        # copy is queued (no await in between), makes exactly this copy fail.
        src, dst = kv[seq.location], kv[dst_name]
        kv.copier.executor(src, dst).submit(setattr, kv.copier.engine(src, dst), "fail_next",
                                            "injected copy failure")
    return inject


# a decode cache of 8 blocks cannot hold 4 requests growing by 60 tokens: evictions follow
COPY_PATHS = [
    pytest.param(("prefill", "host"), {}, id="prefill_to_host"),
    pytest.param(("host", "staging"), {}, id="host_to_staging"),
    pytest.param(("staging", "decode"), {}, id="staging_to_decode"),
    pytest.param(("decode", "staging"), {"num_decode_blocks": 8, "max_tokens": 60},
                 id="decode_to_staging_evict"),
]


@pytest.mark.parametrize("path, config", COPY_PATHS)
async def test_failed_kv_copy_fails_only_its_request(path: tuple[str, str],
                                                     config: dict[str, object]) -> None:
    # NOTE: stores of one tensor hand block tables over and copy nothing that could fail;
    # a tensor per store (as across devices) copies on every path
    await run_with_fault(path, copy_fault, "injected copy failure", share_kv_memory=False,
                         **config)


def host_refusal(engine: Engine) -> Inject:
    """The host pool raises on the next allocation: a copy's `allocate`, a hand-over's
    `reserve`."""
    allocator = engine.ctx.kv["host"].allocator  # type: ignore[union-attr]
    originals = {name: getattr(allocator, name) for name in ("allocate", "reserve")}

    def refuse_once(owner: str, num: int) -> list[int] | None:
        for name, method in originals.items():
            setattr(allocator, name, method)
        raise MemoryError("injected: host pool refused the allocation")

    def inject(seq: SeqState, dst_name: str) -> None:
        for name in originals:
            setattr(allocator, name, refuse_once)
    return inject


@pytest.mark.parametrize("share", [False, True], ids=["copy", "handover"])
async def test_host_pool_refusing_an_allocation_fails_only_its_request(share: bool) -> None:
    await run_with_fault(("prefill", "host"), host_refusal, "host pool refused",
                         when="reserve", share_kv_memory=share)


# -- a dead actor --------------------------------------------------------------------------
@pytest_asyncio.fixture
async def client() -> AsyncIterator[TestClient]:
    app = create_app(make_config(policy="aligned"), ServerConfig(health_details=True))
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_dead_actor_makes_health_503_and_requests_end(client: TestClient) -> None:
    engine = client.server.app[ENGINE]
    runner = next(iter(engine.ctx.runners.values()))

    def crash() -> None:
        raise ActorCrash("injected actor crash")

    runner.fault_hook = crash
    body = {"model": "opt-tiny", "prompt": "hello", "max_tokens": 4}
    resp = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
    assert resp.status == 500 and "prefill0" in (await resp.json())["error"]["message"]
    health = await asyncio.wait_for(client.get("/health"), 5)
    report = await health.json()
    assert health.status == 503 and report["status"] == "unhealthy"
    assert report["actors"]["prefill0"]["alive"] is False
    assert "ActorCrash" in report["actors"]["prefill0"]["last_error"]
    resp = await asyncio.wait_for(client.post("/v1/completions", json=body), 5)
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_unavailable"
