"""The CUDA path of `CopyEngine`: copy streams ordered after the producers, pinned host
staging, peer (device-to-device) copies with a staged fallback, and completion events.

Mechanism only; `transport/copy.py` validates the request and calls `copy_cuda`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from transport.handle import CopyHandle
from transport.kv import KVStore

# NOTE: the store tensors live as long as their stores and are never freed while a copy runs,
# so they need no `record_stream`; every temporary below is allocated while the copy stream of
# its device is current (so the caching allocator ties it to that stream) and is also held by
# the handle until the copy completes.


def copy_cuda(
    streams: dict[torch.device, torch.cuda.Stream],
    has_peer_access: bool,
    fault: Callable[[], None],
    src: KVStore,
    src_ids: list[int],
    dst: KVStore,
    dst_ids: list[int],
    producer: torch.cuda.Stream | None = None,
) -> CopyHandle:
    """Issues the copy of rows `src_ids` of `src` into rows `dst_ids` of `dst` on the copy
    streams and returns at once; the handle's event marks completion.

    Args:
        streams: the engine's copy stream per CUDA device of the pair.
        has_peer_access: whether two different CUDA devices can copy directly.
        fault: called after the gather and before any write to dst (the test hook).
        producer: the stream that wrote the src blocks (default: the current stream of src's
            device); ignored when src is on the host, whose writes are synchronous.
    """
    start_time = time.perf_counter()
    nbytes = len(src_ids) * src.geometry.bytes_per_block
    if not src_ids:
        handle = CopyHandle(0, 0, start_time)
        handle.end_time = start_time  # nothing to copy; callbacks still run on wait()/done()
        return handle
    if src.device.type == "cuda":
        _wait_for_producer(streams[src.device], src.device, producer)
    final_stream = streams[dst.device] if dst.device in streams else streams[src.device]
    start_event = torch.cuda.Event(enable_timing=True)
    done_event = torch.cuda.Event(enable_timing=True)
    handle = CopyHandle(nbytes, len(src_ids), start_time, done_event, start_event)
    with _current_streams(streams):
        rows = _gather(src, src_ids, start_event, final_stream)
        handle.keep_alive(rows)
        fault()
        if dst.device.type == "cpu":
            _write_host(rows, dst, dst_ids, handle)
        else:
            dst_index = _index_on(dst_ids, dst.device)
            rows = _to_device(rows, dst.device, streams, has_peer_access, handle)
            dst.tensor.index_copy_(0, dst_index, rows)
        done_event.record(final_stream)
    return handle


def _wait_for_producer(
    copy_stream: torch.cuda.Stream, device: torch.device, producer: torch.cuda.Stream | None
) -> None:
    """Orders the copy stream of src's device after the work queued so far on `producer`.

    NOTE: only src's producer is waited for. dst's blocks were just allocated, so nothing reads
    them, and waiting for dst's compute stream would forbid the overlap of a copy into the
    decode device with its next iteration. Callers free blocks only once the kernels reading
    them are done (at iteration boundaries, after the results are read back).
    """
    producer_stream = producer if producer is not None else torch.cuda.current_stream(device)
    copy_stream.wait_stream(producer_stream)  # records an event on the producer and waits on it


@contextlib.contextmanager
def _current_streams(streams: dict[torch.device, torch.cuda.Stream]) -> Iterator[None]:
    """Makes each copy stream the current stream of its device, so that every kernel and copy
    below (including torch's own cross-device copies) runs on the copy streams."""
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(torch.cuda.stream(stream))
        yield


def _gather(
    src: KVStore, src_ids: list[int], start_event: torch.cuda.Event, stream: torch.cuda.Stream
) -> torch.Tensor:
    """One `index_select` of the moved rows into a contiguous tensor, pinned when on the host so
    that the following host->device copy is asynchronous. `start_event` is recorded before a
    device gather (device work, timed) and after a host gather (synchronous, not timed)."""
    if src.device.type == "cuda":
        start_event.record(stream)
        src_index = _index_on(src_ids, src.device)
        # [num_moved, num_layers, 2, block_size, num_heads, head_dim]
        return src.tensor.index_select(0, src_index)
    # [num_moved, num_layers, 2, block_size, num_heads, head_dim]
    rows = torch.empty(
        (len(src_ids), *src.geometry.block_shape), dtype=src.tensor.dtype, pin_memory=True
    )
    torch.index_select(src.tensor, 0, _index_on(src_ids, src.device), out=rows)
    start_event.record(stream)
    return rows


def _index_on(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on `device`.

    NOTE: a CUDA index goes through pinned memory: a copy from pageable memory would make the
    host wait for the copy stream to drain (the CUDA rule for pageable host->device copies), so
    `copy` would block behind the copies already in flight.
    """
    index = torch.tensor(block_ids, dtype=torch.long)  # [num_moved]
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _to_device(
    rows: torch.Tensor,
    dst_device: torch.device,
    streams: dict[torch.device, torch.cuda.Stream],
    has_peer_access: bool,
    handle: CopyHandle,
) -> torch.Tensor:
    """Brings gathered rows to the dst device: host->device from pinned memory, or
    device->device over the peer link, staged through pinned host memory without peer access."""
    if rows.device == dst_device:
        return rows
    if rows.device.type == "cpu" or has_peer_access:
        return rows.to(dst_device, non_blocking=True)
    # [num_moved, num_layers, 2, block_size, num_heads, head_dim]
    host_rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host_rows.copy_(rows, non_blocking=True)  # on the src device's copy stream
    is_staged = torch.cuda.Event()
    is_staged.record(streams[rows.device])
    streams[dst_device].wait_event(is_staged)
    handle.keep_alive(host_rows)
    return host_rows.to(dst_device, non_blocking=True)  # on the dst device's copy stream


def _write_host(rows: torch.Tensor, dst: KVStore, dst_ids: list[int], handle: CopyHandle) -> None:
    """device->host: one asynchronous copy straight into dst when `dst_ids` is an ascending run
    of a pinned store (the lowest-first allocator makes that common); otherwise an asynchronous
    copy into pinned staging whose `index_copy_` into dst runs when completion is observed."""
    first_id = dst_ids[0]
    if dst.is_pinned and dst_ids == list(range(first_id, first_id + len(dst_ids))):
        dst.tensor.narrow(0, first_id, len(dst_ids)).copy_(rows, non_blocking=True)
        return
    # [num_moved, num_layers, 2, block_size, num_heads, head_dim]
    host_rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host_rows.copy_(rows, non_blocking=True)
    dst_index = _index_on(dst_ids, dst.device)

    def scatter() -> None:
        dst.tensor.index_copy_(0, dst_index, host_rows)

    handle.add_done_callback(scatter)
