"""The scheduling cores: one I/O-free state machine per kind of instance, driven by the
asyncio engine (aserve/actors/) and by the discrete-event simulator (sim/) alike.

A core takes the current time as an argument and returns what must happen next: forward
passes with their batch, KV moves with source, destination and blocks, lifecycle events.
No asyncio, no torch, no clock here: the driver owns time, devices and copies.
"""

from aserve.cores.base import Forward, Move, Window, Wiring, seq_view
from aserve.cores.batcher import BatcherCore, Order
from aserve.cores.colocated import ColocatedCore
from aserve.cores.decode import DecodeCore
from aserve.cores.kv import BlockLedger
from aserve.cores.lifecycle import Lifecycle, stop_status
from aserve.cores.prefill import PrefillCore

__all__ = ["BatcherCore", "BlockLedger", "ColocatedCore", "DecodeCore", "Forward", "Lifecycle",
           "Move", "Order", "PrefillCore", "Window", "Wiring", "seq_view", "stop_status"]
