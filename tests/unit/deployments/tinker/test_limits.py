"""A request's bounds, checked from its bytes: a declared shape is believed only as far as the datum goes, so a
body of a few hundred bytes cannot make the service build millions of values."""

import tracemalloc

import numpy as np
import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from deployments.tinker.limits import Limits, Refused

LIMITS = Limits(max_context=128, vocab_size=64, max_tokens_per_call=256, max_samples=16, max_lora_rank=8)


def message(tokens=(1, 2), **inputs):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)),
        loss_fn_inputs={"target_tokens": [2] * len(tokens), **(inputs or {"weights": [1.0] * len(tokens)})},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=1
    )
    return forward_backward_request_to_proto(request)


def test_a_sparse_shape_of_twenty_million_is_refused_without_building_it():
    attack = message()
    weights = attack.data[0].loss_fn_inputs["weights"]
    weights.Clear()
    weights.dtype = pb.DTYPE_FLOAT32
    weights.shape.extend([1, 20_000_000])
    weights.sparse_csr.crow_indices = np.zeros(2, dtype=np.int64).tobytes()
    assert len(attack.SerializeToString()) < 200
    tracemalloc.start()
    try:
        with pytest.raises(Refused, match="20000000 values for 2 tokens"):
            LIMITS.loss_call(attack)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # not the 80 MB of the dense tensor, nor the lists after it


def test_a_sparse_tensor_of_the_datums_length_is_read_and_one_whose_indices_lie_is_not():
    sparse = message(tokens=(1, 2, 3))
    weights = sparse.data[0].loss_fn_inputs["weights"]
    weights.Clear()
    weights.dtype = pb.DTYPE_FLOAT32
    weights.shape.extend([1, 3])
    weights.sparse_csr.values = np.asarray([0.5], dtype=np.float32).tobytes()
    weights.sparse_csr.crow_indices = np.asarray([0, 1], dtype=np.int64).tobytes()
    weights.sparse_csr.col_indices = np.asarray([2], dtype=np.int64).tobytes()
    assert LIMITS.loss_call(sparse).data[0].inputs["weights"] == [0.0, 0.0, 0.5]
    weights.sparse_csr.col_indices = np.asarray([7], dtype=np.int64).tobytes()  # past the declared columns
    with pytest.raises(Refused, match="sparse indices"):
        LIMITS.loss_call(sparse)


def test_ranks_and_ids_outside_the_fleets_are_refused_with_the_limit():
    with pytest.raises(Refused, match=r"1\.\.8 \(its max_lora_rank\)"):
        LIMITS.lora_rank(32)
    LIMITS.lora_rank(8)
    with pytest.raises(Refused, match="token id 64 is outside the vocabulary"):
        LIMITS.loss_call(message(tokens=(1, 64)))
