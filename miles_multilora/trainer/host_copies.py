"""Many small tensors to host memory and back in one copy per dtype (on a GPU, pinned, on a side stream).

A parked slot is hundreds of small tensors (A, B, fp32 masters and Adam moments of every layer).
Copying them one by one costs a synchronising copy each (a park of the 1.70 B benchmark shape at
rank 16 took ~400 ms that way). :func:`to_host` gathers a nested dict's float tensors into one flat
buffer per dtype and, on a GPU, copies each buffer to pinned host memory on a copy stream, without
waiting: the step goes on while the copy runs. :func:`to_device` brings them back the same way,
ordered before whatever the current stream runs next (:func:`device_buffers`: the flat buffers
alone). :func:`stage` starts that copy back ahead of time (while a step runs) without ordering
anything after it; ``to_device`` then only waits for it. On a CPU the flat buffers are the host
copy and nothing moves back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TreePath = tuple[str, ...]

_streams: dict[int, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


@dataclass
class HostPack:
    """Where a tree's packed tensors live: one flat host buffer per dtype (pinned on a GPU), each
    tensor's place in it (buffer order), the device they came from, and on a GPU the event after
    which the host buffers hold the data."""

    buffers: dict[torch.dtype, torch.Tensor]
    places: list[tuple[TreePath, torch.dtype, int, torch.Size]]  # tree path, buffer, offset, shape
    device: torch.device
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        """Block until the host buffers are written (before the CPU reads them)."""
        if self.ready is not None:
            self.ready.synchronize()


def _floats(tree: dict, device_type: str, prefix: TreePath = ()) -> list[tuple[TreePath, torch.Tensor]]:
    found = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _floats(value, device_type, (*prefix, key))
        elif (
            isinstance(value, torch.Tensor) and value.device.type == device_type and value.is_floating_point()
        ):
            found.append(((*prefix, key), value))
    return found


def _replaced(
    tree: dict, values: dict[TreePath, torch.Tensor], other: Callable[[Any], Any], prefix: TreePath = ()
) -> dict:
    """``tree`` with the tensors at ``values``' paths replaced, and ``other`` of every other leaf."""
    out = {}
    for key, value in tree.items():
        path = (*prefix, key)
        if isinstance(value, dict):
            out[key] = _replaced(value, values, other, path)
        else:
            out[key] = values[path] if path in values else other(value)
    return out


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def cloned(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` (nested dicts) with every tensor a standalone copy."""
    return _replaced(tree, {}, _clone)


def to_host(tree: dict[str, Any], device_type: str = "cuda") -> tuple[dict[str, Any], HostPack | None]:
    """A copy of ``tree`` (nested dicts): its float tensors on ``device_type`` ("cuda", or "cpu")
    become views of one flat host buffer per dtype (:func:`pack_tensors`); its other tensors are cloned.
    The source tensors may change as soon as this returns. No pack when no float tensor is there."""
    items = _floats(tree, device_type)
    if not items:
        return cloned(tree), None
    host = pack_tensors(items)
    return _replaced(tree, host_views(host), _clone), host


def pack_tensors(items: list[tuple[TreePath, torch.Tensor]]) -> HostPack:
    """``items`` (path, tensor; all on one device) gathered into one flat buffer per dtype, in their
    order within each dtype: on a GPU copied to pinned host memory on a copy stream without waiting
    (``HostPack.wait`` before the CPU reads them); on a CPU the gathered buffers. The tensors may
    change as soon as this returns (the gather is a snapshot on the current stream)."""
    device = items[0][1].device
    groups: dict[torch.dtype, list[tuple[TreePath, torch.Tensor]]] = defaultdict(list)
    for path, t in items:
        groups[t.dtype].append((path, t))
    on_gpu = device.type == "cuda"
    if on_gpu:
        stream, current = _copy_stream(device), torch.cuda.current_stream(device)
    buffers, places = {}, []
    for dtype, group in groups.items():
        flat = torch.cat([t.reshape(-1) for _, t in group])  # on the current stream: a snapshot
        host = flat
        if on_gpu:
            host = torch.empty(flat.numel(), dtype=dtype, pin_memory=True)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                host.copy_(flat, non_blocking=True)
            flat.record_stream(stream)
        offset = 0
        for path, t in group:
            places.append((path, dtype, offset, t.shape))
            offset += t.numel()
        buffers[dtype] = host
    ready = None
    if on_gpu:
        ready = torch.cuda.Event()
        ready.record(stream)
    return HostPack(buffers, places, device, ready)


def host_views(
    host: HostPack, buffers: dict[torch.dtype, torch.Tensor] | None = None
) -> dict[TreePath, torch.Tensor]:
    """Each packed tensor as a view of its host buffer (or of ``buffers``, the same buffers on the
    device), by path."""
    buffers = host.buffers if buffers is None else buffers
    return {
        path: buffers[dtype][offset : offset + shape.numel()].view(shape)
        for path, dtype, offset, shape in host.places
    }


@dataclass
class StagedCopy:
    """A pack's buffers on their way back to the GPU (:func:`stage`): filled once ``ready`` is."""

    buffers: dict[torch.dtype, torch.Tensor]
    ready: torch.cuda.Event

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


def device_room(device: torch.device) -> int:
    """Bytes ``device`` can still hold at the step's peak: free memory now, less what the caching
    allocator will take again on its way back to the highest it has reserved so far."""
    free, _ = torch.cuda.mem_get_info(device)
    growth = max(0, torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device))
    return max(0, free - growth)


def stage(pack: HostPack) -> StagedCopy:
    """Start copying ``pack``'s buffers back to the GPU on the copy stream and return at once; no
    stream waits for it until :func:`to_device` takes it (a copy never taken is simply dropped)."""
    stream = _copy_stream(pack.device)
    with torch.cuda.stream(stream):
        buffers = {dtype: host.to(pack.device, non_blocking=True) for dtype, host in pack.buffers.items()}
    ready = torch.cuda.Event()
    ready.record(stream)
    return StagedCopy(buffers, ready)


def device_buffers(pack: HostPack, staged: StagedCopy | None = None) -> dict[torch.dtype, torch.Tensor]:
    """``pack``'s flat buffers on its device: on a GPU one copy per dtype on the copy stream (or the
    copy :func:`stage` started), which the current stream waits for; on a CPU the buffers."""
    if pack.device.type != "cuda":
        return pack.buffers
    current = torch.cuda.current_stream(pack.device)
    if staged is None:
        staged = stage(pack)
    current.wait_event(staged.ready)
    for t in staged.buffers.values():
        t.record_stream(current)
    return staged.buffers


def to_device(tree: dict[str, Any], pack: HostPack, staged: StagedCopy | None = None) -> dict[str, Any]:
    """``tree`` (as :func:`to_host` returned it) with its packed tensors on ``pack``'s device (see
    :func:`device_buffers`)."""
    if pack.device.type != "cuda":
        return tree
    return _replaced(tree, host_views(pack, device_buffers(pack, staged)), lambda value: value)
