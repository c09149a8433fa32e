"""Frames round-trip exactly; malformed ones raise ProtocolError, never anything else. Tensors travel by name, and
a frame carries exactly the names its message kind allows; frames of another protocol version name both."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest
import torch

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.compat import discard_frame, legacy_error_frame
from corolla.protocol.errors import ProtocolError, RemoteError
from corolla.protocol.framing import decode_frame, encode_frame
from corolla.protocol.messages import (
    BackwardResult,
    ErrorCode,
    ErrorReply,
    InferenceStep,
    OpenSession,
    QuantMode,
    ServerInfo,
    ServerState,
)


def raw_frame(header: dict, data: bytes = b"") -> bytes:
    """A payload built by hand (no length prefix), as a peer might send it."""
    packed = msgpack.packb(header)
    return len(packed).to_bytes(4, "big") + packed + data


def step_header(tensors: list, **msg) -> dict:
    return {"v": PROTOCOL_VERSION, "msg": {"kind": "inference_step", "step_id": 1, "position": 0, **msg}, "tensors": tensors}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_named_tensors_round_trip_bit_exactly(dtype):
    hidden = (torch.randn(2, 3, 5) * 100).to(dtype)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    tensors = {"hidden": hidden, "attention_mask": mask, "prompts": hidden[:, :0]}
    message, decoded = decode_frame(encode_frame(InferenceStep(step_id=3, position=7), tensors))
    assert message == InferenceStep(step_id=3, position=7)
    assert list(decoded) == ["hidden", "attention_mask", "prompts"]
    assert torch.equal(decoded["hidden"], hidden) and torch.equal(decoded["attention_mask"], mask)
    assert decoded["prompts"].shape == (2, 0, 5)


def test_optional_tensors_may_come_in_any_order_or_not_at_all():
    hidden, prompts = torch.zeros(1, 2, 4), torch.ones(2, 1, 4)
    _, decoded = decode_frame(encode_frame(InferenceStep(step_id=1, position=0), {"prompts": prompts, "hidden": hidden}))
    assert torch.equal(decoded["prompts"], prompts) and torch.equal(decoded["hidden"], hidden)
    _, decoded = decode_frame(encode_frame(BackwardResult(), {"grad_hidden": hidden}))
    assert list(decoded) == ["grad_hidden"]


@pytest.mark.parametrize("names, error", [
    (["hidden", "mask"], "inference_step carries no tensor 'mask'; its tensors: hidden, attention_mask .optional."),
    (["hidden", "prompts", "prompts"], "inference_step carries tensor 'prompts' twice"),
    (["attention_mask"], "inference_step needs tensor 'hidden'"),
    ([], "inference_step needs tensor 'hidden'"),
])
def test_unknown_repeated_or_missing_tensor_names_are_refused(names, error):
    tensors = [[name, "float32", [1, 1, 2]] for name in names]
    with pytest.raises(ProtocolError, match=error):
        decode_frame(raw_frame(step_header(tensors), b"\x00" * 8 * len(names)))


def test_the_sender_cannot_attach_a_tensor_its_message_does_not_carry():
    with pytest.raises(ProtocolError, match="open_session carries no tensor 'hidden'"):
        encode_frame(OpenSession(protocol_version=PROTOCOL_VERSION, blocks={"start": 0, "end": 1}, max_length=8),
                     {"hidden": torch.zeros(1)})


def test_unknown_fields_and_kinds_are_rejected():
    with pytest.raises(ProtocolError, match="evil"):
        decode_frame(raw_frame(step_header([], evil=1)))
    with pytest.raises(ProtocolError):
        decode_frame(raw_frame({"v": PROTOCOL_VERSION, "msg": {"kind": "nope"}, "tensors": []}))


def test_a_frame_of_another_protocol_version_names_both_versions():
    v1 = {"msg": {"kind": "inference_step", "step_id": 1, "position": 0}, "tensors": [["float32", [1, 1, 2]]]}
    with pytest.raises(ProtocolError, match=f"peer speaks corolla protocol v1, this side speaks v{PROTOCOL_VERSION}"):
        decode_frame(raw_frame(v1, b"\x00" * 8))
    with pytest.raises(ProtocolError, match=f"v{PROTOCOL_VERSION + 1}, this side speaks v{PROTOCOL_VERSION}"):
        decode_frame(raw_frame({**step_header([]), "v": PROTOCOL_VERSION + 1}))


def test_bad_tensor_specs_are_named():
    with pytest.raises(ProtocolError, match=r"expected \[name, dtype, shape\]"):
        decode_frame(raw_frame(step_header([["float32", [1, 1, 2]]])))
    with pytest.raises(ProtocolError, match="unsupported dtype 'complex64' of tensor 'hidden'"):
        decode_frame(raw_frame(step_header([["hidden", "complex64", [1]]])))
    with pytest.raises(ProtocolError, match="bad shape"):
        decode_frame(raw_frame(step_header([["hidden", "float32", [-1]]])))


def test_out_of_range_fields_are_rejected():
    with pytest.raises(ValueError):
        OpenSession(protocol_version=PROTOCOL_VERSION, blocks={"start": 3, "end": 2}, max_length=8)


def test_truncated_or_oversized_tensor_data_is_rejected():
    payload = encode_frame(InferenceStep(step_id=1, position=0), {"hidden": torch.zeros(4, 4)})
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frame(payload[:-1])
    with pytest.raises(ProtocolError, match="trailing"):
        decode_frame(payload + b"x")


def test_random_bytes_raise_protocol_error_only():
    for seed in range(200):
        data = os.urandom(seed % 50 + 1)
        with pytest.raises(ProtocolError):
            decode_frame(data)


def test_error_codes_and_quantization_modes_are_enums_equal_to_their_wire_strings():
    reply, _ = decode_frame(encode_frame(ErrorReply(code=ErrorCode.SERVER_FULL, message="full")))
    assert reply.code is ErrorCode.SERVER_FULL and reply.code == "server_full"
    assert RemoteError("timeout", "slow").code is ErrorCode.TIMEOUT
    info = ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0, cache_tokens_total=1,
                      cache_tokens_free=1, torch_dtype="float32", quant="nf4", version="0", protocol_version=1,
                      max_session_length=8)
    assert info.quant is QuantMode.NF4 and info.model_dump(mode="json")["quant"] == "nf4"
    with pytest.raises(ValueError):
        ServerInfo.model_validate({**info.model_dump(mode="json"), "quant": "int3"})


def test_handler_names_carry_the_protocol_version():
    assert rpc_handler_name("inference") == f"corolla/v{PROTOCOL_VERSION}/rpc_inference"
    assert rpc_handler_name("forward", 1) == "corolla/v1/rpc_forward"


def test_a_legacy_error_frame_is_what_a_v1_peer_decodes():
    frame = legacy_error_frame(1, "speak v2")
    length = int.from_bytes(frame[:8], "big")
    assert length == len(frame) - 8
    header_len = int.from_bytes(frame[8:12], "big")
    assert msgpack.unpackb(frame[12 : 12 + header_len]) == {
        "msg": {"kind": "error", "code": "bad_request", "message": "speak v2"}, "tensors": []}
    with pytest.raises(ValueError):
        legacy_error_frame(PROTOCOL_VERSION, "not legacy")


def test_discard_frame_reads_exactly_one_frame():
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data((3_000_000).to_bytes(8, "big") + b"\x01" * 3_000_000 + b"next")
        reader.feed_eof()
        await discard_frame(reader)
        return await reader.read()

    assert asyncio.run(scenario()) == b"next"
