"""Many small GPU tensors to pinned host memory and back in one copy per dtype, on a side stream.

A parked slot is hundreds of small tensors (A, B, fp32 masters and Adam moments of every layer).
Copying them one by one costs a synchronising copy each (a park of the 1.70 B benchmark shape at
rank 16 took ~400 ms that way). :func:`to_host` gathers a nested dict's CUDA float tensors into
one flat buffer per dtype on the GPU and copies each buffer to pinned host memory on a copy stream,
without waiting: the step goes on while the copy runs. :func:`to_device` brings them back the same
way, ordered before whatever the current stream runs next.
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
    """Where a tree's packed tensors live: one pinned flat buffer per dtype, each tensor's place in
    it, and the event after which the host buffers hold the data."""

    buffers: dict[torch.dtype, torch.Tensor]
    places: list[tuple[TreePath, torch.dtype, int, torch.Size]]  # tree path, buffer, offset, shape
    device: torch.device
    ready: torch.cuda.Event

    def wait(self) -> None:
        """Block until the host buffers are written (before the CPU reads them)."""
        self.ready.synchronize()


def _cuda_floats(tree: dict, prefix: TreePath = ()) -> list[tuple[TreePath, torch.Tensor]]:
    found = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _cuda_floats(value, (*prefix, key))
        elif isinstance(value, torch.Tensor) and value.is_cuda and value.is_floating_point():
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


def to_host(tree: dict[str, Any]) -> tuple[dict[str, Any], HostPack | None]:
    """A copy of ``tree`` (nested dicts): its CUDA float tensors become views of pinned host buffers,
    filled asynchronously (``HostPack.wait`` before reading them on the CPU); its other tensors are
    cloned. The source tensors may change as soon as this returns. No pack when nothing is on CUDA."""
    items = _cuda_floats(tree)
    if not items:
        return cloned(tree), None
    device = items[0][1].device
    groups: dict[torch.dtype, list[tuple[TreePath, torch.Tensor]]] = defaultdict(list)
    for path, t in items:
        groups[t.dtype].append((path, t))
    stream, current = _copy_stream(device), torch.cuda.current_stream(device)
    buffers, places, views = {}, [], {}
    for dtype, group in groups.items():
        flat = torch.cat([t.reshape(-1) for _, t in group])  # on the current stream: a snapshot
        host = torch.empty(flat.numel(), dtype=dtype, pin_memory=True)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            host.copy_(flat, non_blocking=True)
        flat.record_stream(stream)
        offset = 0
        for path, t in group:
            places.append((path, dtype, offset, t.shape))
            views[path] = host[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
        buffers[dtype] = host
    ready = torch.cuda.Event()
    ready.record(stream)
    return _replaced(tree, views, _clone), HostPack(buffers, places, device, ready)


def to_device(tree: dict[str, Any], pack: HostPack) -> dict[str, Any]:
    """``tree`` (as :func:`to_host` returned it) with its packed tensors back on the GPU: one copy per
    dtype on the copy stream, which the current stream waits for."""
    stream, current = _copy_stream(pack.device), torch.cuda.current_stream(pack.device)
    on_device = {}
    with torch.cuda.stream(stream):
        for dtype, host in pack.buffers.items():
            on_device[dtype] = host.to(pack.device, non_blocking=True)
    current.wait_stream(stream)
    for t in on_device.values():
        t.record_stream(current)
    views = {
        path: on_device[dtype][offset : offset + shape.numel()].view(shape)
        for path, dtype, offset, shape in pack.places
    }
    return _replaced(tree, views, lambda value: value)
