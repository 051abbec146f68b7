"""The engine's step-cost model (aserve/engine/step_probe.py): `aligned` gets
scheduler/cost_model.py's model of the engine's geometry and attention backend, fitted to a
start-up probe of synthetic decode steps; every engine probes at start-up, whatever its
policy, and the benchmark writes the probe's steps into its iteration logs as calibration
rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from aserve import Engine
from aserve.engine.step_probe import PROBE_BATCH, EngineStepCost
from scheduler.step_time import RecomputedStep, growing_step
from tests.conftest import make_config


@pytest.mark.parametrize("attention,kernel", [("paged", "split-k"), ("padded", "padded")])
async def test_aligned_decides_with_a_model_fitted_to_a_startup_probe(attention: str,
                                                                      kernel: str) -> None:
    async with Engine(make_config(policy="aligned", attention=attention)) as engine:
        step_time = engine.ctx.policy.step_time  # type: ignore[union-attr]
        assert isinstance(step_time, EngineStepCost)
        assert step_time.kernel == kernel and step_time.source != "priors"
        assert step_time([100] * PROBE_BATCH) > 0
        # the refill loop's incremental form: the very numbers of the fitted model
        grown = growing_step(step_time, [100] * PROBE_BATCH)
        assert not isinstance(grown, RecomputedStep)
        assert grown.time_with(700) == step_time([100] * PROBE_BATCH + [700])
        assert not any(engine.ctx.kv.blocks_used().values())  # type: ignore[union-attr]


async def test_every_engine_probes_batch_sizes_up_to_what_its_cache_holds() -> None:
    """The probe runs under fcfs too (its steps calibrate the simulator from any run's log),
    and its batches grow past PROBE_BATCH: a calibration fitted to steps of at most 25 seqs
    priced steps of 32-45 at 1.15-1.29x their time."""
    config = make_config(policy="fcfs", max_batch_size=64)
    async with Engine(config) as engine:
        probed = engine.probe_iterations
        assert probed and all(r.instance == "probe" and r.forward_time > 0 for r in probed)
        assert all(r.new_tokens == (1,) * r.batch_size == (1,) * len(r.lengths)
                   for r in probed)
        sizes = sorted({r.batch_size for r in probed})
        assert sizes == [1, PROBE_BATCH, 2 * PROBE_BATCH, 4 * PROBE_BATCH, 8 * PROBE_BATCH]
        blocks = [sum(-(-n // 16) for n in r.lengths) for r in probed]
        assert max(blocks) <= config.cache.num_decode_blocks - 1  # block 0 is never written
        assert not any(engine.ctx.kv.blocks_used().values())  # type: ignore[union-attr]
        step_time = engine.ctx.policy.step_time  # type: ignore[union-attr]
        assert isinstance(step_time, EngineStepCost) and step_time.source != "priors"


def test_the_fit_is_cached_per_machine_and_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The probe's fit is written once and read by every later start-up with the same
    machine and probe (the same decisions on every run); another probe fits anew."""
    from models.opt import OPTConfig

    rows = [{"forward_time": 1e-3 * (1 + len(lengths)) + 1e-6 * sum(lengths),
             "batch_size": len(lengths), "num_prefill_tokens": 0, "lengths": lengths,
             "new_tokens": [1] * len(lengths)}
            for lengths in ([33] * 8, [129] * 8, [513] * 8, [513], [33] * 7 + [513])]
    first = EngineStepCost(OPTConfig(), "padded", "cpu", 2, rows, tmp_path)
    assert first.source == "probe" and len(list(tmp_path.iterdir())) == 1
    slower = [{**r, "forward_time": 1.1 * r["forward_time"]} for r in rows]
    second = EngineStepCost(OPTConfig(), "padded", "cpu", 2, slower, tmp_path)
    assert second.source == str(next(tmp_path.iterdir()))
    assert second.model.params == first.model.params
    other = EngineStepCost(OPTConfig(), "padded", "cpu", 2, slower[1:], tmp_path)
    assert other.source == "probe" and len(list(tmp_path.iterdir())) == 2
    uncached = EngineStepCost(OPTConfig(), "padded", "cpu", 2, slower, None)
    assert uncached.source == "probe" and uncached.model.params != first.model.params


def test_the_cache_key_names_the_instruction_sets_and_the_version(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two CPUs of one model name, with and without AVX-512, two releases of this
    package, or two versions of its kernels run different code: their step times must not
    share a calibration."""
    import aserve
    from aserve.engine import step_probe
    from models import cpu_isa

    key = step_probe.machine("cpu")
    assert cpu_isa.detect().level in str(key["device"])
    assert key["aserve"] == aserve.__version__
    original = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: original(self) + (
        b"# edited" if self.name == "opt.py" else b""))
    step_probe.models_fingerprint.cache_clear()
    try:
        assert step_probe.machine("cpu")["models"] != key["models"]
    finally:
        monkeypatch.undo()
        step_probe.models_fingerprint.cache_clear()
    assert step_probe.machine("cpu")["models"] == key["models"]
