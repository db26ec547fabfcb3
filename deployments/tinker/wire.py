"""The Tinker SDK's protobuf bodies, both ways, with the SDK's own generated messages (`tinker_public_pb2`).

The SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` (zstd-compressed when the server's client
config says so) and asks for `ForwardBackwardOutput` and `SampleResponse` results as protobuf (`Accept:
application/x-protobuf`); it ships the encoder of the one and the decoders of the others
(`tinker.proto.request_conv`, `tinker.proto.response_conv`). This module is their mirror on the server's side, built on
the same generated classes, so a field the SDK renames fails here loudly instead of drifting: a request becomes a
`contracts.tinker.LossCall` for the learner, and the learner's and the fleet's answers become the SDK's messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from contracts.tinker import Datum, LossCall

PROTOBUF = "application/x-protobuf"
TOKEN_DTYPE = np.dtype(np.int32)  # how the SDK packs a text chunk's token ids
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that is not what the SDK sends (a 400 with this reason)."""


class TooLarge(WireError):
    """A body that inflates past the service's limit (a 413, as one sent that large)."""


@dataclass(frozen=True)
class ForwardBackward:
    """A decoded `/api/v1/forward_backward`: which client, its place in the client's order, and the call."""

    model_id: str
    seq_id: int
    call: LossCall


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent before `Content-Encoding: zstd`, refusing one that inflates past `limit` bytes before it
    holds more than that: a frame that declares a larger size at once, any other as soon as it streams past it."""
    if not encoding or encoding.lower() == "identity":
        return body
    if encoding.lower() != "zstd":
        raise WireError(f"Content-Encoding {encoding!r}: only zstd is accepted")
    try:
        declared = zstandard.frame_content_size(body)
        if declared > limit:  # -1: not declared
            raise TooLarge(f"the body inflates to {declared} bytes, over the limit of {limit}")
        chunks, size = [], 0
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise TooLarge(f"the body inflates past the limit of {limit} bytes")
    except zstandard.ZstdError as exc:
        raise WireError(f"zstd body: {exc}") from None
    return b"".join(chunks)


def tensor_length(tensor: pb.Tensor, name: str) -> int:
    """How many values `tensor` holds once dense, from its bytes, without building it: a declared shape must be what
    its data holds, and a sparse tensor's indices must be consistent (its shape is the only size it declares)."""
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: dtype {tensor.dtype} is not float32, int32 or int64")
    itemsize = np.dtype(dtype).itemsize
    shape = list(tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape[:8]} has a negative size")
    if tensor.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor must be 2-D, got shape {shape[:8]}")
        csr = tensor.sparse_csr
        if len(csr.values) % itemsize or len(csr.crow_indices) % 8 or len(csr.col_indices) % 8:
            raise WireError(f"loss_fn_inputs[{name!r}]: sparse values or indices are not whole numbers")
        nnz = len(csr.values) // itemsize
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        consistent = (
            len(crow) == shape[0] + 1
            and len(cols) == nnz
            and crow[0] == 0
            and crow[-1] == nnz
            and bool(np.all(np.diff(crow) >= 0))
            and (nnz == 0 or (int(cols.min()) >= 0 and int(cols.max()) < shape[1]))
        )
        if not consistent:
            raise WireError(f"loss_fn_inputs[{name!r}]: its sparse indices do not fit its shape {shape}")
        return shape[0] * shape[1]
    if len(tensor.dense) % itemsize:
        raise WireError(f"loss_fn_inputs[{name!r}]: its data is not whole {np.dtype(dtype).name} values")
    count = len(tensor.dense) // itemsize
    if shape and int(np.prod(shape, dtype=object)) != count:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape[:8]} does not hold its {count} values")
    return count


def tensor_values(tensor: pb.Tensor, name: str, length: int) -> np.ndarray:
    """A dense (or CSR) `Tensor`'s values, flat: `length` of them, or a WireError before anything is built."""
    count = tensor_length(tensor, name)
    if count != length:
        raise WireError(f"loss_fn_inputs[{name!r}] holds {count} values for {length} tokens")
    dtype = _NUMPY[tensor.dtype]
    if not tensor.HasField("sparse_csr"):
        return np.frombuffer(tensor.dense, dtype=dtype)
    rows, cols = list(tensor.shape)
    csr = tensor.sparse_csr
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    dense = np.zeros((rows, cols), dtype=dtype)
    for row in range(rows):
        dense[row, col[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
    return dense.reshape(-1)


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The SDK's protobuf `ForwardBackwardRequest`, parsed only: which client, which turn, how large (its bytes are
    bounded by the body's limit; nothing of it is decoded yet)."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and its kin
        raise WireError(f"not a ForwardBackwardRequest: {exc}") from None
    if not message.model_id:
        raise WireError("model_id: missing")
    if not message.data:
        raise WireError("forward_backward_input.data: no datums")
    return message


def loss_call(message: pb.ForwardBackwardRequest) -> LossCall:
    """A parsed request as a `LossCall` (text chunks only: the tiny models see no images); each loss input must hold
    one value per token of its datum."""
    data = []
    for i, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"data[{i}]: only encoded_text chunks are supported, got {chunk.WhichOneof('chunk')}")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=TOKEN_DTYPE).tolist())
        if "target_tokens" not in datum.loss_fn_inputs:
            raise WireError(f"data[{i}]: loss_fn_inputs['target_tokens'] is missing")
        inputs = {name: tensor_values(t, name, len(tokens)) for name, t in datum.loss_fn_inputs.items()}
        targets = inputs.pop("target_tokens")
        data.append(
            Datum(
                input_tokens=tokens,
                target_tokens=targets.astype(np.int64).tolist(),
                inputs={k: v.astype(np.float32).tolist() for k, v in inputs.items()},
            )
        )
    config: dict[str, float] = {}
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config[{key!r}]: text values are not supported")
        config[key] = value.number
    for key, number in message.loss_fn_config.items():
        config.setdefault(key, number)
    return LossCall(message.model_id, data, message.loss_fn, config, backward=not message.forward_only)


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """The SDK's protobuf `ForwardBackwardRequest` as a `LossCall`, its client and its turn."""
    message = parse_forward_backward(body)
    return ForwardBackward(message.model_id, message.seq_id, loss_call(message))


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    itemsize = np.dtype(_NUMPY[dtype]).itemsize
    offsets = np.cumsum([0] + [len(a) * itemsize for a in arrays]).astype(np.int64)
    data = b"".join(np.asarray(a, dtype=_NUMPY[dtype]).tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=dtype)


def encode_forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """The SDK's protobuf `ForwardBackwardOutput`: per datum its `logprobs`, and the metrics."""
    record = pb.ArrayRecord(
        type_tag="ArrayRecord",
        num_datums=len(logprobs),
        fields={"logprobs": _batched([np.asarray(lp, dtype=np.float32) for lp in logprobs], pb.DTYPE_FLOAT32)},
    )
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics)
    return output.SerializeToString()


STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclass(frozen=True)
class Sequence:
    """One sampled sequence as the fleet answered it."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def encode_sample_response(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """The SDK's protobuf `SampleResponse`; a prompt position without a log-prob (the first) travels as NaN, which
    the SDK reads as None."""
    out = pb.SampleResponse()
    for seq in sequences:
        item = out.sequences.add()
        item.stop_reason = STOP_REASONS.get(seq.finish_reason, pb.STOP_REASON_LENGTH)
        item.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        item.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()
