"""The engine's step-cost model (aserve/engine/step_probe.py): `aligned` gets
scheduler/cost_model.py's model of the engine's geometry and attention backend, fitted to a
start-up probe of synthetic decode steps; every engine probes at start-up, whatever its
policy, and the benchmark writes the probe's steps into its iteration logs as calibration
rows."""

from __future__ import annotations

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
        assert step_time.kernel == kernel and step_time.num_fits == 1
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
        assert isinstance(step_time, EngineStepCost) and step_time.num_fits == 1


def test_a_refit_keeps_the_probes_imbalance_weight_that_aligned_records_cannot_show() -> None:
    """An `aligned` run on padded attention records steps whose timings the fit can explain
    without any charge for the spread of lengths (here: they were made so); fitted to them
    alone, the refit dropped the probe's imbalance weight to 0 and `aligned` then mixed
    lengths. The refit keeps the probe's imbalance weight and
    takes the rest from the records."""
    import dataclasses

    from aserve.engine.sequence import IterationRecord
    from models.opt import OPTConfig
    from scheduler.calibrate import fit
    from scheduler.cost_model import CostModel, CostParams

    probe_truth = CostParams(step_overhead=0.0, per_seq_overhead=7e-4, bw_efficiency=0.56,
                             flops_efficiency=0.44, imbalance_scale=2.8)
    blind = dataclasses.replace(probe_truth, per_seq_overhead=5e-3, imbalance_scale=0.0)
    records: list[IterationRecord] = []
    cost = EngineStepCost(OPTConfig(), "padded", "cpu", 2, records)
    n, longest = PROBE_BATCH, 512
    m = cost.model
    truth = CostModel(m.geometry, m.hardware, probe_truth, m.kernel)
    probed = [{"forward_time": truth.iteration_time([x + 1 for x in lengths]), "batch_size":
               len(lengths), "num_prefill_tokens": 0, "lengths": [x + 1 for x in lengths]}
              for lengths in ([32] * n, [128] * n, [longest] * n, [longest],
                              [32] * (n - 1) + [longest])]
    cost = EngineStepCost(OPTConfig(), "padded", "cpu", 2, records, probed)
    assert cost.model.params.imbalance_scale > 1.0  # the probe shows the padding's price
    seen = CostModel(m.geometry, m.hardware, blind, m.kernel)
    for i in range(200):  # steps of 8-16 seqs, lengths within 1.5x of each other
        lo = 40 + 3 * i
        lengths = [lo + (lo // 2) * j // 15 for j in range(8 + i % 9)]
        records.append(IterationRecord("decode0", float(i), len(lengths), 0, min(lengths),
                                       max(lengths), seen.iteration_time(lengths), 0.0,
                                       False, {}, tuple(lengths), (1,) * len(lengths)))
    cost.refit()
    assert cost.num_fits == 2  # the records' constants were taken...
    assert cost.model.params.imbalance_weight == pytest.approx(cost.imbalance_weight)  # ...
    assert cost.model.params.imbalance_scale > 1.0  # but not their price of the padding
    alone = fit([dataclasses.asdict(r) for r in records], m.geometry, "cpu", "padded", 2)
    assert alone.params.imbalance_scale < 0.5  # what the records alone would have fitted


def test_refits_run_off_the_calling_thread_over_a_bounded_window() -> None:
    """However many records the engine has kept, a refit fits at most REFIT_WINDOW of them,
    on a worker thread; the caller keeps deciding with the current model meanwhile."""
    import threading

    from aserve.engine.sequence import IterationRecord
    from aserve.engine.step_probe import REFIT_WINDOW
    from models.opt import OPTConfig

    records = [IterationRecord("decode0", float(i), 4, 0, 40, 40 + i % 7, 1e-3 * (1 + i % 3),
                               0.0, False, {}, (40,) * 3 + (40 + i % 7,), (1,) * 4)
               for i in range(3 * REFIT_WINDOW)]
    cost = EngineStepCost(OPTConfig(), "padded", "cpu", 2, records)
    fitted: list[tuple[str, int]] = []
    done = threading.Event()
    refitted = cost._refitted

    def spy(window: list[IterationRecord]) -> object:
        fitted.append((threading.current_thread().name, len(window)))
        try:
            return refitted(window)
        finally:
            done.set()

    cost._refitted = spy  # type: ignore[method-assign]
    model = cost.model
    cost([40, 50])  # due: starts a refit and answers with the model it has
    assert cost.model is model
    assert done.wait(60)
    [(thread, num)] = fitted
    assert thread.startswith("aserve-refit") and num == REFIT_WINDOW
    cost._fitting.result()  # type: ignore[union-attr]
    cost([40, 50])  # takes the refit's model when it is better (never blocks on it)
    assert cost._fitting is None and cost.next_fit > len(records)
