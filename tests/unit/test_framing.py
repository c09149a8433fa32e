"""Frames round-trip exactly; malformed ones raise ProtocolError, never anything else."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch

from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import decode_frame, encode_frame
from corolla.protocol.messages import InferenceStep, OpenSession


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensors_round_trip_bit_exactly(dtype):
    tensor = (torch.randn(2, 3, 5) * 100).to(dtype)
    message, tensors = decode_frame(encode_frame(InferenceStep(step_id=3, position=7), [tensor, tensor[:, :0]]))
    assert message == InferenceStep(step_id=3, position=7)
    assert torch.equal(tensors[0], tensor) and tensors[1].shape == (2, 0, 5)


def test_unknown_fields_and_kinds_are_rejected():
    header = msgpack.packb({"msg": {"kind": "inference_step", "step_id": 1, "position": 0, "evil": 1}, "tensors": []})
    with pytest.raises(ProtocolError, match="evil"):
        decode_frame(len(header).to_bytes(4, "big") + header)
    header = msgpack.packb({"msg": {"kind": "nope"}, "tensors": []})
    with pytest.raises(ProtocolError):
        decode_frame(len(header).to_bytes(4, "big") + header)


def test_out_of_range_fields_are_rejected():
    with pytest.raises(ValueError):
        OpenSession(protocol_version=1, blocks={"start": 3, "end": 2}, max_length=8)


def test_truncated_or_oversized_tensor_data_is_rejected():
    payload = encode_frame(InferenceStep(step_id=1, position=0), [torch.zeros(4, 4)])
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frame(payload[:-1])
    with pytest.raises(ProtocolError, match="trailing"):
        decode_frame(payload + b"x")


def test_random_bytes_raise_protocol_error_only():
    for seed in range(200):
        data = os.urandom(seed % 50 + 1)
        with pytest.raises(ProtocolError):
            decode_frame(data)
