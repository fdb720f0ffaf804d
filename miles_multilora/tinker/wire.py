"""The protobuf bodies of the Tinker protocol (the pinned SDK's own message classes, no pickle).

``forward_backward`` requests arrive as ``ForwardBackwardRequest``; its results and sampling
results go back as ``ForwardBackwardOutput`` / ``SampleResponse``. Token ids are int32
little-endian, loss inputs dense float32 / int64 little-endian tensors. Decoded tokens and loss
inputs stay numpy arrays (no per-value Python objects); anything malformed is a
:class:`TinkerError` naming the field.
"""

from __future__ import annotations

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from miles_multilora.tinker.requests import (
    Datum,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    SampleOutput,
    TinkerError,
)

PROTOBUF = "application/x-protobuf"
TOPK_EMPTY_LOGPROB = -99999.0  # with token id 0: a top-k row that was not scored (the SDK reads None)
_DTYPES = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}


def _array(buffer: bytes, dtype: str, where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(buffer) % size:
        raise TinkerError(where, f"holds {len(buffer)} bytes, not a whole number of {size}-byte values")
    return np.frombuffer(buffer, dtype)


def _tensor(t: pb.Tensor, where: str) -> np.ndarray:
    if t.WhichOneof("encoding") != "dense":
        raise TinkerError(where, "only dense tensors are supported (pass 1-D lists or arrays)")
    if t.dtype not in _DTYPES:
        name = pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else str(t.dtype)
        raise TinkerError(where, f"unsupported dtype {name}")
    values = _array(t.dense, _DTYPES[t.dtype], where)
    shape = [int(s) for s in t.shape]
    if len(shape) not in (1, 2) or int(np.prod(shape)) != len(values):
        raise TinkerError(
            where, f"must be 1-D (or [N, K]) with its shape set; got shape {shape} for {len(values)} values"
        )
    return values.reshape(shape)  # which inputs may be [N, K] is the loss's to say (backend.check)


def decode_forward_backward(body: bytes) -> tuple[ForwardBackwardRequest, int | None]:
    """A ``ForwardBackwardRequest`` body -> the backend's request and its ``seq_id``."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others
        raise TinkerError("body", f"not a tinker_public.ForwardBackwardRequest: {exc}") from exc
    data = []
    for i, d in enumerate(msg.data):
        where = f"data[{i}].model_input"
        chunks = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise TinkerError(where, "only encoded_text chunks are supported")
            chunks.append(_array(chunk.encoded_text.tokens, "<i4", where))
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, "<i4")
        inputs = {k: _tensor(v, f"data[{i}].loss_fn_inputs.{k}") for k, v in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
        else:
            raise TinkerError(f"loss_fn_config.{k}", "must be a number")
    for k, v in config.items():
        if not np.isfinite(v):
            raise TinkerError(f"loss_fn_config.{k}", f"must be a finite number, got {v}")
    request = ForwardBackwardRequest(
        msg.model_id, data, msg.loss_fn or "cross_entropy", config, msg.forward_only
    )
    return request, (int(msg.seq_id) if msg.seq_id > 0 else None)


def encode_forward_backward(out: ForwardBackwardOutput) -> bytes:
    """Each datum's ``logprobs`` (float32; ``[N]``, or ``[N, K]`` for ``[N, K]`` targets) and the
    metrics: one ``ArrayRecord`` per run of datums whose logprobs share a trailing shape."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [np.asarray(lp, "<f4") for lp in out.logprobs]
    start = 0
    while start < len(arrays) or not msg.loss_fn_outputs:
        end = start
        while end < len(arrays) and arrays[end].shape[1:] == arrays[start].shape[1:]:
            end += 1
        record = msg.loss_fn_outputs.add()
        record.num_datums = end - start
        field = record.fields["logprobs"]
        field.dtype = pb.DTYPE_FLOAT32
        if end > start:
            field.trailing_shape.extend(arrays[start].shape[1:])
        blobs = [a.tobytes() for a in arrays[start:end]]
        field.data = b"".join(blobs)
        field.offsets = np.cumsum([0, *(len(b) for b in blobs)]).astype("<i8").tobytes()
        start = end
    for k, v in out.metrics.items():
        msg.metrics[k] = float(v)
    return msg.SerializeToString()


def _topk(msg: pb.TopkLogprobs, ids: np.ndarray, values: np.ndarray) -> None:
    msg.token_ids = np.asarray(ids, "<i4").tobytes()
    msg.logprobs = np.asarray(values, "<f4").tobytes()
    msg.length, msg.k = ids.shape


def _dense(msg: pb.Tensor, values: np.ndarray, dtype: int) -> None:
    msg.dense = values.astype(_DTYPES[dtype]).tobytes()
    msg.dtype = dtype
    msg.shape.extend(values.shape)


def encode_samples(output: SampleOutput) -> bytes:
    """A ``SampleResponse``: tokens, logprobs, stop reason (and top-k when asked for) of each sample,
    in request order, and the prompt's logprobs (NaN where not scored), top-k (sentinel rows
    there), target logprobs (in the request's dense or sparse layout) and alternative draws."""
    msg = pb.SampleResponse()
    for i, r in enumerate(output.sequences):
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if r.finish_reason == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(r.output_ids, "<i4").tobytes()
        seq.logprobs = np.asarray(r.logprobs, "<f4").tobytes()
        if output.sample_topk is not None:
            ids, values = output.sample_topk[i]
            if ids:
                _topk(seq.topk_sampled_logprobs, np.asarray(ids), np.asarray(values))
    scores = output.prompt
    if scores is None:
        return msg.SerializeToString()
    if scores.logprobs is not None:
        logprobs = np.full(scores.length, np.nan, "<f4")
        logprobs[scores.first :] = scores.logprobs
        msg.prompt_logprobs = logprobs.tobytes()
    if scores.k > 0 and scores.topk_ids is not None and scores.topk_logprobs is not None:
        k = scores.k
        ids = np.zeros((scores.length, k), "<i4")
        values = np.full((scores.length, k), TOPK_EMPTY_LOGPROB, "<f4")
        if scores.first < scores.length:
            ids[scores.first :] = np.asarray(scores.topk_ids, "<i4").reshape(-1, k)
            values[scores.first :] = np.asarray(scores.topk_logprobs, "<f4").reshape(-1, k)
        _topk(msg.topk_prompt_logprobs, ids, values)
    if scores.target_logprobs is not None and scores.targets is not None:
        target = msg.target_prompt_logprobs
        if scores.targets.csr is None:
            _dense(target, scores.target_logprobs, pb.DTYPE_FLOAT32)
        else:  # the request's layout: the values of its listed cells
            crow, col = scores.targets.csr
            rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
            target.sparse_csr.values = scores.target_logprobs[rows, col].astype("<f4").tobytes()
            target.sparse_csr.crow_indices = crow.astype("<i8").tobytes()
            target.sparse_csr.col_indices = col.astype("<i8").tobytes()
            target.dtype = pb.DTYPE_FLOAT32
            target.shape.extend(scores.target_logprobs.shape)
    if scores.alt_ids is not None and scores.alt_logprobs is not None:
        _dense(msg.prompt_alt_tokens.tokens, scores.alt_ids, pb.DTYPE_INT64)
        _dense(msg.prompt_alt_tokens.logprobs, scores.alt_logprobs, pb.DTYPE_FLOAT32)
    return msg.SerializeToString()
