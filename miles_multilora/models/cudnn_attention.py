"""Causal attention within packed rows on cuDNN's fused attention (ragged ``[T, heads, d]`` layout).

The packed train path (``models.packed_rows``) runs each micro-batch's rows back to back as one
sequence; ATen's variable-length flash kernel (FA2) runs its attention at ~300 TFLOP/s in the
backward on Hopper. cuDNN's fused attention has faster Hopper kernels, but builds a graph per shape
(tens of milliseconds): PyTorch's own cuDNN path keys its graphs on the exact shape, and its ragged
(nested-tensor) path builds one on every call, so neither suits micro-batches that change shape
every step. Here a graph is keyed on *bounds*: the row count, the longest row and the total tokens
each rounded up to a power of two (rows past the micro-batch's have length 0), with the heads, the
groups, the head dim and the dtype (the inputs are made contiguous). A run meets a handful of keys;
each builds once, before the call computes anything, and a key cuDNN refuses raises
:class:`NotSupported` (``trainer.attention=auto`` then runs the flash kernel).

Needs the ``cudnn`` module (``pip install nvidia-cudnn-frontend``), a Hopper or newer GPU and 16-bit
floats; :func:`available` says whether this process has them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

try:  # the optional cuDNN frontend
    import cudnn  # type: ignore[import-not-found]
except (ImportError, OSError):  # not installed, or no cuDNN library to load
    cudnn = None

_LOCK = threading.Lock()
_GRAPHS: dict[tuple, Any] = {}
_REFUSED: dict[tuple, str] = {}  # graph keys cuDNN could not build, with its reason
_HANDLES: dict[int, Any] = {}


def available(q: torch.Tensor) -> bool:
    """Whether cuDNN's ragged attention can run ``q``'s attention here."""
    return (
        cudnn is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(q.device)[0] >= 9
    )


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _handle(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    handle = _HANDLES[index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
    return handle


def _io_type(dtype: torch.dtype) -> Any:
    return cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF


@dataclass
class _Bounds:
    rows: int  # b of the graph: rows past the real ones have length 0
    longest: int  # s of the graph
    tokens: int  # the most tokens the graph's backward sizes its workspace for


def _dims(t: torch.Tensor, bounds: _Bounds) -> tuple[list[int], list[int]]:
    """A contiguous ``[T, heads, d]`` as cuDNN's ``[b, heads, s, d]`` (rows by ragged offsets)."""
    heads, d = t.shape[1], t.shape[2]
    return [bounds.rows, heads, bounds.longest, d], [bounds.longest * heads * d, d, heads * d, 1]


def _offset_type() -> torch.dtype:
    return torch.int64 if cudnn.backend_version() >= 90600 else torch.int32


class _Graph:
    """A cuDNN graph over packed rows: its row lengths, ragged offsets and ``q``/``k``/``v`` inputs
    (every ``[T, heads, d]`` tensor seen as ``[rows, heads, longest, d]``, rows placed by offsets)."""

    def __init__(self, q, k, v, bounds: _Bounds, handle) -> None:
        g = cudnn.pygraph(
            io_data_type=_io_type(q.dtype),
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        self.graph, self.bounds = g, bounds
        offset_type = cudnn.data_type.INT64 if _offset_type() == torch.int64 else cudnn.data_type.INT32
        self.q_off, self.k_off, self.v_off, self.o_off, self.s_off = (
            g.tensor(name=n, dim=[bounds.rows + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=offset_type)
            for n in ("q_off", "k_off", "v_off", "o_off", "stats_off")
        )
        self.lens, self.lens_kv = (
            g.tensor(name=n, dim=[bounds.rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
            for n in ("seq_len", "seq_len_kv")
        )
        self.q, self.k, self.v = (
            self.rows_tensor(name, t, offset)
            for name, t, offset in (("q", q, self.q_off), ("k", k, self.k_off), ("v", v, self.v_off))
        )
        self.masks = dict(
            use_causal_mask=True, use_padding_mask=True, seq_len_q=self.lens, seq_len_kv=self.lens_kv
        )

    def rows_tensor(self, name: str, like: torch.Tensor, offset: Any) -> Any:
        """An input shaped and placed like ``like`` (``[T, heads, d]``)."""
        dim, stride = _dims(like, self.bounds)
        tensor = self.graph.tensor(name=name, dim=dim, stride=stride, data_type=_io_type(like.dtype))
        tensor.set_ragged_offset(offset)
        return tensor

    def output(self, tensor: Any, like: torch.Tensor, offset: Any) -> Any:
        """Mark ``tensor`` an output shaped and placed like ``like``."""
        dim, stride = _dims(like, self.bounds)
        tensor.set_output(True).set_dim(dim).set_stride(stride)
        tensor.set_ragged_offset(offset)
        return tensor

    def stats_dims(self, heads: int) -> tuple[list[int], list[int]]:
        """The softmax statistics, fp32 ``[T, heads, 1]``, as cuDNN's ``[rows, heads, longest, 1]``."""
        b = self.bounds
        return [b.rows, heads, b.longest, 1], [b.longest * heads, 1, heads, 1]

    def run(self, rows: dict[str, torch.Tensor], **tensors: torch.Tensor) -> None:
        """Execute on ``tensors`` (by attribute name: ``q``, ``o``, ``dq``, ...) and the micro-batch's
        row tensors (:func:`_row_tensors`)."""
        pack = {getattr(self, name): t for name, t in tensors.items()}
        pack.update({
            self.lens: rows["lens"], self.lens_kv: rows["lens"], self.q_off: rows["q"],
            self.k_off: rows["kv"], self.v_off: rows["kv"], self.o_off: rows["q"], self.s_off: rows["stats"],
        })  # fmt: skip
        device = tensors["q"].device
        workspace = torch.empty(self.workspace, device=device, dtype=torch.uint8)
        self.graph.execute(pack, workspace, handle=_handle(device))

    def build(self) -> None:
        g = self.graph
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.workspace = g.get_workspace_size()


class _Forward(_Graph):
    """The forward: output and softmax statistics."""

    def __init__(self, q, k, v, bounds: _Bounds, scale: float, handle) -> None:
        super().__init__(q, k, v, bounds, handle)
        o, stats = self.graph.sdpa(
            name="sdpa", q=self.q, k=self.k, v=self.v, generate_stats=True, attn_scale=scale, **self.masks
        )
        self.o = self.output(o, q, self.o_off)
        dim, stride = self.stats_dims(q.shape[1])
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(dim).set_stride(stride)
        stats.set_ragged_offset(self.s_off)
        self.stats = stats
        self.build()


class _Backward(_Graph):
    """The backward: ``dq``, ``dk``, ``dv`` from the output, its gradient and the statistics."""

    def __init__(self, q, k, v, bounds: _Bounds, scale: float, handle) -> None:
        super().__init__(q, k, v, bounds, handle)
        self.o, self.do = (self.rows_tensor(n, q, self.o_off) for n in ("o", "do"))
        dim, stride = self.stats_dims(q.shape[1])
        self.stats = self.graph.tensor(name="stats", dim=dim, stride=stride, data_type=cudnn.data_type.FLOAT)
        self.stats.set_ragged_offset(self.s_off)
        dq, dk, dv = self.graph.sdpa_backward(
            name="sdpa_backward", q=self.q, k=self.k, v=self.v, o=self.o, dO=self.do, stats=self.stats,
            attn_scale=scale, max_total_seq_len_q=bounds.tokens, max_total_seq_len_kv=bounds.tokens,
            **self.masks,
        )  # fmt: skip
        self.dq = self.output(dq, q, self.q_off)
        self.dk = self.output(dk, k, self.k_off)
        self.dv = self.output(dv, v, self.v_off)
        self.build()


def _key(kind: str, q, k, v, bounds: _Bounds, scale: float) -> tuple:
    tokens = bounds.tokens if kind == "bwd" else 0  # only the backward sizes a workspace by it
    return (kind, q.device.index, q.dtype, scale, bounds.rows, bounds.longest, tokens,
            tuple(q.shape[1:]), tuple(k.shape[1:]))  # fmt: skip


def _graph(kind: str, q, k, v, bounds: _Bounds, scale: float) -> Any:
    """The built graph of ``kind`` for these shapes (built here the first time)."""
    key = _key(kind, q, k, v, bounds, scale)
    with _LOCK:
        graph = _GRAPHS.get(key)
        if graph is None:
            graph = (_Forward if kind == "fwd" else _Backward)(q, k, v, bounds, scale, _handle(q.device))
            _GRAPHS[key] = graph
    return graph


class NotSupported(RuntimeError):
    """cuDNN cannot build the attention's graph for these shapes (head dim, heads, GPU, version)."""


def _prepare(q, k, v, bounds: _Bounds, scale: float, backward: bool) -> tuple[Any, Any]:
    """The forward graph and (where a backward will run) the backward graph, built or found before
    the call computes anything, so a shape cuDNN refuses is known first; raises
    :class:`NotSupported` (remembered per key)."""
    graphs = []
    for kind in ("fwd", "bwd") if backward else ("fwd",):
        key = _key(kind, q, k, v, bounds, scale)
        if key in _REFUSED:
            raise NotSupported(_REFUSED[key])
        try:
            graphs.append(_graph(kind, q, k, v, bounds, scale))
        except Exception as exc:  # the frontend raises its own and plain runtime errors
            _REFUSED[key] = f"{type(exc).__name__}: {exc}"
            raise NotSupported(_REFUSED[key]) from exc
    return graphs[0], graphs[1] if backward else None


def _ragged(cu_seqlens: torch.Tensor, rows: int, scale_by: int) -> torch.Tensor:
    """Element offsets of each row (``cu_seqlens * scale_by``), rows past the real ones at the end."""
    real = cu_seqlens.to(_offset_type()) * scale_by
    pad = rows + 1 - real.shape[0]
    if pad:
        real = torch.cat([real, real[-1:].expand(pad)])
    return real.view(-1, 1, 1, 1)


def _lengths(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    pad = rows - lens.shape[0]
    if pad:
        lens = torch.cat([lens, lens.new_zeros(pad)])
    return lens.view(-1, 1, 1, 1)


def _row_tensors(cu_seqlens: torch.Tensor, bounds: _Bounds, q, k, cache: dict) -> dict[str, torch.Tensor]:
    """The row lengths and each tensor's ragged offsets (elements), made once per micro-batch."""
    heads, groups, d = q.shape[1], k.shape[1], q.shape[2]
    key = (bounds.rows, heads, groups, d)
    if key not in cache:
        cache[key] = {
            "lens": _lengths(cu_seqlens, bounds.rows),
            "q": _ragged(cu_seqlens, bounds.rows, heads * d),
            "kv": _ragged(cu_seqlens, bounds.rows, groups * d),
            "stats": _ragged(cu_seqlens, bounds.rows, heads),
        }
    return cache[key]


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, bounds: _Bounds, graphs: tuple[Any, Any], cache: dict):  # type: ignore[override]
        rows = _row_tensors(cu_seqlens, bounds, q, k, cache)
        o = torch.empty_like(q)
        stats = torch.empty(q.shape[0], q.shape[1], 1, device=q.device, dtype=torch.float32)
        graphs[0].run(rows, q=q, k=k, v=v, o=o, stats=stats)
        ctx.save_for_backward(q, k, v, o, stats, cu_seqlens)
        ctx.bounds, ctx.backward_graph, ctx.cache = bounds, graphs[1], cache
        return o

    @staticmethod
    def backward(ctx, grad_o):  # type: ignore[override]
        q, k, v, o, stats, cu_seqlens = ctx.saved_tensors
        rows = _row_tensors(cu_seqlens, ctx.bounds, q, k, ctx.cache)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.backward_graph.run(
            rows, q=q, k=k, v=v, o=o, do=grad_o.contiguous(), stats=stats, dq=dq, dk=dk, dv=dv
        )
        return dq, dk, dv, None, None, None, None


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    longest: int,
    scale: float,
    cache: dict | None = None,
) -> torch.Tensor:
    """Causal attention within each row: ``q`` ``[T, heads, d]`` over ``k``/``v`` ``[T, groups, d]``,
    rows at ``cu_seqlens`` (int32, ``[rows + 1]``, on the GPU); the inputs are made contiguous.
    ``cache``: a dict kept for the micro-batch (its layers share the row tensors made from
    ``cu_seqlens``). Raises :class:`NotSupported` before computing anything where cuDNN cannot
    build the graphs."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bounds = _Bounds(
        rows=_pow2(cu_seqlens.shape[0] - 1), longest=_pow2(longest, 64), tokens=_pow2(q.shape[0], 1024)
    )
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    graphs = _prepare(q, k, v, bounds, scale, backward)
    return _PackedAttention.apply(q, k, v, cu_seqlens, bounds, graphs, {} if cache is None else cache)
