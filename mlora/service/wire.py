"""Tinker's protobuf messages, read and written with the SDK's own generated module
(``tinker.proto.tinker_public_pb2``): ``forward_backward`` requests in, their outputs out.

Tokens are little-endian int32 bytes; a tensor is dense bytes in its dtype or sparse CSR (int64 indices);
per-datum outputs are one ``BatchedTensor`` whose ``offsets`` are byte offsets into the concatenated data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mlora.service.losses import check_shapes

_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32, 4: np.uint16}  # DTYPE_FLOAT32, INT64, INT32, BFLOAT16


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # pragma: no cover - the package is a test and service dependency
        raise ImportError("the Tinker service needs the tinker SDK's protobuf module: pip install tinker==0.38.0"
                          ) from e
    return tinker_public_pb2


@dataclass
class Datum:
    """One training example: the input tokens ``[N]`` and its ``loss_fn_inputs`` (each ``[N]``, or ``[N, K]`` with
    K targets per position)."""

    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    """A decoded ``ForwardBackwardRequest``."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(t, name: str) -> torch.Tensor:
    """A proto ``Tensor`` as a dense torch tensor (bfloat16 widened to float32, int32 to int64)."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise ValueError(f"loss_fn_inputs[{name!r}]: unsupported dtype enum {t.dtype}")
    shape = tuple(int(s) for s in t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        values = torch.from_numpy(np.frombuffer(csr.values, dtype=dtype).copy())
        crow = torch.from_numpy(np.frombuffer(csr.crow_indices, dtype=np.int64).copy())
        col = torch.from_numpy(np.frombuffer(csr.col_indices, dtype=np.int64).copy())
        out = torch.sparse_csr_tensor(crow, col, values, size=shape).to_dense()
    else:
        out = torch.from_numpy(np.frombuffer(t.dense, dtype=dtype).copy())
        if out.numel() != int(np.prod(shape)):
            raise ValueError(f"loss_fn_inputs[{name!r}]: {out.numel()} values for shape {list(shape)}")
        out = out.reshape(shape)
    if t.dtype == 4:  # bfloat16 bits: the upper half of a float32
        out = (out.to(torch.int32) << 16).view(torch.float32)
    return out.to(torch.int64) if t.dtype == 3 else out


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """Parse a ``ForwardBackwardRequest``; ValueError for what mlora cannot take (images) or inputs whose shapes do
    not fit the datum (:func:`mlora.service.losses.check_shapes`)."""
    from google.protobuf.message import DecodeError

    pb = _pb()
    req = pb.ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as e:  # the SDK retries a server error for ever: a bad body is the client's
        raise ValueError(f"malformed request: the body is not a ForwardBackwardRequest ({e})") from None
    config: dict[str, float | str] = dict(req.loss_fn_config)
    for key, value in req.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    data, ks = [], []
    for i, d in enumerate(req.data):
        parts = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ValueError(f"datum {i}: model_input chunk of kind {kind!r}; this server takes encoded_text only")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
        tokens = torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0, dtype=torch.long)
        inputs = {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}
        if not len(tokens):
            raise ValueError(f"datum {i}: empty model_input")
        if "target_tokens" in inputs:  # (a request without them fails naming them: check_loss)
            try:
                k = check_shapes(req.loss_fn, tokens.shape[0], inputs)
            except ValueError as e:
                raise ValueError(f"datum {i}: {e}") from None
            if data and k != ks[0]:  # the output's per-datum log-probs share one trailing shape
                raise ValueError(f"datum {i} has {k or 1} targets per position, datum 0 {ks[0] or 1}: the datums of "
                                 "one request take the same K")
            ks.append(k)
        data.append(Datum(tokens, inputs))
    return ForwardBackward(req.model_id, int(req.seq_id), req.loss_fn, config, bool(req.forward_only), data)


def encode_forward_backward_output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: each datum's learner log-probs (float32 ``[N]``, or ``[N, K]``: the trailing shape)
    and ``name:reduction`` metrics."""
    pb = _pb()
    arrays = [lp.detach().to(torch.float32).cpu().contiguous().numpy() for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays))
    record.fields["logprobs"].CopyFrom(pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32,
        trailing_shape=list(arrays[0].shape[1:]) if arrays else []))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.loss_fn_outputs.append(record)
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()
