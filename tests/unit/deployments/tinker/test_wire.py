"""The service's protobuf side against the SDK's own: what the SDK encodes decodes here, what is encoded here the
SDK decodes (`tinker.proto.request_conv`, `tinker.proto.response_conv`), zstd included."""

import math
import tracemalloc

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from deployments.tinker.wire import (
    Sequence,
    TooLarge,
    WireError,
    decode_forward_backward,
    decompress,
    encode_forward_backward_output,
    encode_sample_response,
)


def sdk_request(forward_only: bool = False, **config) -> bytes:
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 0.5]},
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([9, 10]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[10, 11], dtype="int64", shape=[2]),
                "logprobs": [-1.0, -2.0],
                "advantages": [0.5, 0.5],
            },
        ),
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="ppo", loss_fn_config=config or None),
        model_id="s:train:0",
        seq_id=3,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def test_a_forward_backward_request_of_the_sdk_decodes_to_a_loss_call():
    decoded = decode_forward_backward(sdk_request(clip_low_threshold=0.7))
    assert (decoded.model_id, decoded.seq_id) == ("s:train:0", 3)
    call = decoded.call
    assert call.loss_fn == "ppo" and call.backward and call.config == {"clip_low_threshold": pytest.approx(0.7)}
    first, second = call.data
    assert (first.input_tokens, first.target_tokens, first.inputs) == ([5, 6, 7], [6, 7, 8], {"weights": [0, 1, 0.5]})
    assert second.target_tokens == [10, 11] and second.inputs == {"logprobs": [-1, -2], "advantages": [0.5, 0.5]}
    assert not decode_forward_backward(sdk_request(forward_only=True)).call.backward


def test_zstd_bodies_inflate_and_are_bounded():
    body = sdk_request()
    packed = zstandard.ZstdCompressor().compress(body)
    assert decompress(packed, "zstd", 1 << 20) == body
    for declared in (True, False):  # a frame that says its size is refused by it, one that does not as it streams
        bomb = zstandard.ZstdCompressor(write_content_size=declared).compress(b"\0" * (64 << 20))
        with pytest.raises(TooLarge, match="inflates"):
            tracemalloc.start()
            try:
                decompress(bomb, "zstd", 1 << 20)
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
        assert peak < 8 << 20, peak  # never inflated to 64 MiB on the way to the refusal
    with pytest.raises(WireError, match="zstd"):
        decompress(b"no zstd frame", "zstd", 1 << 20)
    with pytest.raises(WireError, match="gzip"):
        decompress(body, "gzip", 1 << 20)


def test_malformed_requests_say_why():
    with pytest.raises(WireError, match="ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")
    with pytest.raises(WireError, match="model_id"):
        decode_forward_backward(b"")


def test_the_sdk_reads_a_forward_backward_output_encoded_here():
    output = deserialize_forward_backward_output(
        encode_forward_backward_output([[-1.0, -2.5], [-0.25]], {"loss:sum": 3.75})
    )
    assert output.metrics == {"loss:sum": 3.75}
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]


def test_the_sdk_reads_a_sample_response_encoded_here():
    sequences = [Sequence([4, 5], [-0.5, -1.5], "stop"), Sequence([6], [-2.0], "length")]
    response = deserialize_sample_response(encode_sample_response(sequences, [None, -3.0, -0.5]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([4, 5], [-0.5, -1.5], "stop"),
        ([6], [-2.0], "length"),
    ]
    assert response.prompt_logprobs == [None, -3.0, -0.5]
    assert deserialize_sample_response(encode_sample_response(sequences, None)).prompt_logprobs is None
    assert not any(math.isnan(x) for x in np.asarray(response.sequences[0].logprobs))
