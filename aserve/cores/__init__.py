"""The scheduling cores: one I/O-free state machine per kind of instance, driven by the
asyncio engine (aserve/driver.py) and by the discrete-event simulator (sim/drivers.py) alike.

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

from aserve.cores.base import Core, Forward, Move, Window, seq_views
from aserve.cores.batcher import MATCH_STAGING_SHARE, BatcherCore, Order
from aserve.cores.colocated import ColocatedCore
from aserve.cores.decode import DecodeCore
from aserve.cores.ledger import LOCATIONS, BlockLedger, kv_stores
from aserve.cores.lifecycle import Lifecycle
from aserve.cores.prefill import PrefillCore
from aserve.cores.wiring import Driver, Wiring

__all__ = ["LOCATIONS", "MATCH_STAGING_SHARE", "BatcherCore", "BlockLedger", "ColocatedCore",
           "Core", "DecodeCore", "Driver", "Forward", "Lifecycle", "Move", "Order",
           "PrefillCore", "Window", "Wiring", "kv_stores", "seq_views"]
