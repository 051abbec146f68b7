"""The wiring wakes a prefill the policy holds back (`Policy.prefill_quota`), and the
batcher that may wait for its prompts (`Policy.incoming`), whenever the hold turns on or
off, whatever turned it: a request starting, or seqs entering or leaving a decode
instance. Missed, the two waited for each other and requests were never served."""

from __future__ import annotations

from dataclasses import dataclass, field

from aserve.cores.wiring import Wiring


@dataclass
class Prefill:
    """What the wiring reads of a PrefillCore."""

    is_held: bool
    waiting: list[str] = field(default_factory=lambda: ["prompt"])

    def held(self) -> bool:
        return self.is_held


@dataclass
class Driver:
    core: object
    wakes: int = 0

    def wake(self) -> None:
        self.wakes += 1


def wired(prefill: Prefill) -> tuple[Wiring, Driver, Driver]:
    wiring = Wiring()
    wiring.prefills = [Driver(prefill)]
    wiring.batcher = Driver(object())
    return wiring, wiring.prefills[0], wiring.batcher  # type: ignore[return-value]


def test_a_hold_lifted_by_admissions_wakes_the_prefill_and_the_batcher() -> None:
    prefill = Prefill(is_held=True)
    wiring, driver, batcher = wired(prefill)
    wiring.holds_may_change()  # the first look
    driver.wakes = batcher.wakes = 0
    wiring.holds_may_change()
    assert driver.wakes == batcher.wakes == 0  # no change, no wake
    prefill.is_held = False  # evicted seqs came back: more run than wait to start
    wiring.holds_may_change()
    assert driver.wakes == 1 and batcher.wakes == 1
    prefill.is_held = True  # the decode instance drained: the batcher stops waiting
    wiring.holds_may_change()
    assert batcher.wakes == 2


def test_a_request_starting_looks_at_the_hold_too() -> None:
    prefill = Prefill(is_held=True)
    wiring, driver, batcher = wired(prefill)
    wiring.holds_may_change()
    batcher.wakes = 0
    prefill.is_held = False
    wiring.started()
    assert driver.wakes >= 1 and batcher.wakes == 1


def test_a_prefill_with_nothing_waiting_is_left_alone() -> None:
    prefill = Prefill(is_held=False, waiting=[])
    wiring, driver, batcher = wired(prefill)
    wiring.holds_may_change()
    assert driver.wakes == batcher.wakes == 0
