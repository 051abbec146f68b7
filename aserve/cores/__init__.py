"""The scheduling cores: one I/O-free state machine per kind of instance, driven by the
asyncio engine (aserve/engine/actors.py) and by the discrete-event simulator (sim/drivers.py) alike.

A core takes the current time as an argument and returns what must happen next: forward
passes with their batch, KV moves with source, destination and blocks, lifecycle events.
No asyncio, no torch, no clock here: the driver owns time, devices and copies.

One request's state lives here and nowhere else: its status and lifecycle events are
written by `Lifecycle` (the one finish path), its KV blocks are counted by `BlockLedger`.
Sections, in the order a request meets them: the data the cores hand their drivers and
the `Wiring` between instances; `BlockLedger`; `Lifecycle`; `PrefillCore`; `BatcherCore`
(host pool + batch generator); `DecodeCore` (the boundary rules); `ColocatedCore` (the
`continuous` baseline).
"""

from aserve.cores.base import (
    BatcherMessage,
    Core,
    Forward,
    Move,
    Pooled,
    StagingFreed,
    WantsBatch,
    Window,
    WindowReport,
    seq_views,
)
from aserve.cores.batcher import MATCH_STAGING_SHARE, BatcherCore, Order
from aserve.cores.colocated import ColocatedCore
from aserve.cores.decode import DecodeCore
from aserve.cores.ledger import LOCATIONS, BlockLedger, kv_stores
from aserve.cores.lifecycle import Lifecycle
from aserve.cores.prefill import PrefillCore
from aserve.cores.wiring import Driver, Wiring

__all__ = ["LOCATIONS", "MATCH_STAGING_SHARE", "BatcherCore", "BatcherMessage", "BlockLedger",
           "ColocatedCore", "Core", "DecodeCore", "Driver", "Forward", "Lifecycle", "Move",
           "Order", "Pooled", "PrefillCore", "StagingFreed", "WantsBatch", "Window",
           "WindowReport", "Wiring", "kv_stores", "seq_views"]
