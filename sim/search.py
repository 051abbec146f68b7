"""Fair comparisons on one cluster: each disaggregated system at its best prefill:decode split
(DistServe's placement search, reduced to the split of a fixed number of GPUs), colocated
systems on all of them; and the share of a run's decode time lost to kernel imbalance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.metrics import DEFAULT_TPOT_SLO, Summary
from bench.workloads import Workload
from scheduler import POLICIES
from scheduler.cost_model import CostModel
from sim.cluster import ClusterConfig
from sim.run import SimResult, simulate

Split = tuple[int, int]  # (prefill devices, decode devices)
ConfigFor = Callable[[int, int], ClusterConfig]  # (num_prefill, num_decode) -> cluster
DEFAULT_HORIZON = 3600.0  # simulated seconds after the last arrival before a run is cut off
DEFAULT_MAX_EVENTS = 5_000_000  # loop events before a run is cut off (a livelock's guard)


class MeteredCost(CostModel):
    """A CostModel that adds up, over decode-only iterations, the predicted step time and
    the part of it that is attention imbalance (the per-seq kernel's waves, padding)."""

    def __init__(self, base: CostModel) -> None:
        super().__init__(base.geometry, base.hardware, base.params, base.kernel)
        self.decode_time = 0.0  # seconds of decode iterations
        self.imbalance_time = 0.0  # of which imbalance

    def iteration_time(self, decode_lengths: Sequence[int],
                       prefill_chunks: Sequence[tuple[int, int]] = ()) -> float:
        f = self.features(decode_lengths, prefill_chunks)
        duration = self.time_of(f)
        if decode_lengths and not prefill_chunks:
            self.decode_time += duration
            self.imbalance_time += self.lost_to_imbalance(decode_lengths)
        return duration

    @property
    def imbalance_share(self) -> float:
        """Imbalance / decode step time; NaN before any decode step."""
        return self.imbalance_time / self.decode_time if self.decode_time else math.nan


@dataclass
class Placement:
    """One system at its best split: the chosen run and what every split gave."""

    system: str
    split: Split  # the chosen one; a colocated system reports (0, all devices)
    result: SimResult
    imbalance_share: float  # of the chosen run's decode step time
    tried: dict[Split, float] = field(default_factory=dict)  # split -> decode tok/s (NaN: cut off)

    @property
    def finished(self) -> bool:
        return self.result.num_finished == self.result.num_requests

    def summary(self, tpot_slo: float = DEFAULT_TPOT_SLO) -> Summary:
        return self.result.summary(tpot_target=tpot_slo)

    @property
    def label(self) -> str:
        p, d = self.split
        where = f"all {d}" if p == 0 else f"{p}+{d}"
        return f"{self.system} @{where}" + ("" if self.finished else " (CUT OFF)")


def splits_of(num_devices: int) -> list[Split]:
    """Every split of `num_devices` with at least one prefill and one decode device.

    Raises:
        ValueError: for fewer than 2 devices.
    """
    if num_devices < 2:
        raise ValueError(f"num_devices ({num_devices}) must be >= 2 to split")
    return [(p, num_devices - p) for p in range(1, num_devices)]


def run_bounded(workload: Workload, system: str, config: ClusterConfig, cost: CostModel,
                horizon: float = DEFAULT_HORIZON,
                max_events: int | None = DEFAULT_MAX_EVENTS) -> tuple[SimResult, float]:
    """One run cut off `horizon` simulated seconds after the last arrival or after
    `max_events` events; returns it and its decode imbalance share."""
    metered = MeteredCost(cost)
    last = max((r.arrival_time for r in workload.requests), default=0.0)
    result = simulate(workload, system, config, metered, horizon=last + horizon,
                      max_events=max_events)
    return result, metered.imbalance_share


def best_split(workload: Workload, system: str, splits: Sequence[Split], config_for: ConfigFor,
               cost: CostModel, horizon: float = DEFAULT_HORIZON,
               max_events: int | None = DEFAULT_MAX_EVENTS) -> Placement:
    """`system` at the split of highest decode throughput among runs that finished (if none
    did, the one that finished most requests); a colocated system (no host pool) runs once,
    on every device of the first split.

    Raises:
        ValueError: for an unknown system or no splits.
    """
    if system not in POLICIES:
        raise ValueError(f"system ({system!r}) must be one of {sorted(POLICIES)}")
    if not splits:
        raise ValueError("splits must name at least one (prefill, decode) split")
    if not POLICIES[system].uses_pool:
        p, d = splits[0]
        result, share = run_bounded(workload, system, config_for(p, d), cost, horizon,
                                    max_events)
        return Placement(system, (0, p + d), result, share,
                         {(0, p + d): _throughput(result)})
    runs = {split: run_bounded(workload, system, config_for(*split), cost, horizon, max_events)
            for split in splits}
    tried = {split: _throughput(result) for split, (result, _) in runs.items()}
    split = max(runs, key=lambda s: (runs[s][0].num_finished, _or_zero(tried[s])))
    result, share = runs[split]
    return Placement(system, split, result, share, tried)


def _throughput(result: SimResult) -> float:
    """Decode tok/s of a run that finished; NaN for one that was cut off."""
    if result.num_finished < result.num_requests:
        return math.nan
    return result.summary(tpot_target=math.inf).decode_throughput


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value
