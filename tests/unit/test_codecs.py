"""Activation codecs (protocol.codecs) and their framing: sizes, errors, determinism, and limits on decoding."""

from __future__ import annotations

import pytest
import torch

from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.codecs import CODECS, LOSSLESS, check_codec, decode, encode, encoded_bytes, roundtrip
from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import decode_frame, encode_frame
from corolla.protocol.messages import InferenceStep

# (bytes per float32 value, largest relative L2 error per position on N(0, 1) rows with an outlier)
# ("deflate": at most; its size depends on the values)
EXPECTED = {"none": (4.0, 0.0), "bf16": (2.0, 4e-3), "fp16": (2.0, 1e-3), "int8": (1.0625, 3e-2), "4bit": (0.5625, 0.2),
            "deflate": (3.5, 0.0)}


def activations() -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(2, 37, 256)
    x[0, 3, 17] = 40.0  # an outlier feature, as residual streams have
    return x


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_has_its_size_and_error(codec):
    x = activations()
    raw = encode(codec, x)
    per_value, max_error = EXPECTED[codec]
    if codec == "deflate":
        assert len(raw) <= min(encoded_bytes(codec, x.shape, x.dtype), per_value * x.numel())
    else:
        assert len(raw) == encoded_bytes(codec, x.shape, x.dtype) == round(per_value * x.numel())
    y = decode(codec, raw, list(x.shape), x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    error = float(((y - x).norm(dim=-1) / x.norm(dim=-1)).max())
    assert error <= max_error
    assert (error == 0) == (codec in LOSSLESS)


@pytest.mark.parametrize("codec", CODECS)
def test_decoding_is_deterministic_so_a_receipt_of_the_decoded_tensor_matches(codec):
    x = activations()
    raw = encode(codec, x)
    assert torch.equal(decode(codec, raw, list(x.shape), x.dtype), decode(codec, bytes(raw), list(x.shape), x.dtype))
    assert torch.equal(roundtrip(codec, x), decode(codec, raw, list(x.shape), x.dtype))


def test_codecs_handle_sizes_that_are_not_whole_blocks_and_empty_tensors():
    for codec in CODECS:
        x = torch.randn(1, 3, 5)
        assert decode(codec, encode(codec, x), [1, 3, 5], torch.float32).shape == (1, 3, 5)
        assert decode(codec, encode(codec, torch.empty(1, 0, 8)), [1, 0, 8], torch.float32).shape == (1, 0, 8)


def test_fp16_clamps_instead_of_overflowing_to_inf():
    x = torch.tensor([[[1e6, -1e6, 1.0]]])
    assert torch.isfinite(roundtrip("fp16", x)).all()


def test_an_unknown_codec_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="none, bf16, fp16, int8, 4bit, deflate"):
        check_codec("zip")


def test_a_frame_carries_hidden_states_in_a_codec_and_decodes_them_to_floats():
    hidden, mask = activations(), torch.ones(2, 37, dtype=torch.bool)
    payload = encode_frame(InferenceStep(step_id=1, position=0), {"hidden": hidden, "attention_mask": mask}, "int8")
    assert len(payload) < hidden.numel() * 1.1 + 2 * 37 + 1024  # a quarter of float32's bytes, plus the mask
    _, tensors = decode_frame(payload)
    assert tensors["hidden"].dtype == torch.float32 and torch.equal(tensors["hidden"], roundtrip("int8", hidden))
    assert torch.equal(tensors["attention_mask"], mask)  # masks always travel exact


def test_a_coded_tensor_decoding_past_the_readers_limit_is_refused():
    hidden = torch.randn(1, 64, 256)
    payload = encode_frame(InferenceStep(step_id=1, position=0), {"hidden": hidden}, "4bit")
    assert len(payload) < 64 * 256
    with pytest.raises(ProtocolError, match="decodes to 65536 bytes"):
        decode_frame(payload, max_bytes=len(payload) * 2)


def test_a_codec_on_a_mask_or_an_unknown_codec_is_refused():
    import msgpack
    header = {"v": PROTOCOL_VERSION, "msg": InferenceStep(step_id=1, position=0).model_dump(mode="json"),
              "tensors": [["hidden", "float32", [1, 1, 4], "int8"], ["attention_mask", "bool", [1, 1], "int8"]]}
    raw = msgpack.packb(header)
    with pytest.raises(ProtocolError, match="cannot travel in codec"):
        decode_frame(len(raw).to_bytes(4, "big") + raw + b"\0" * 200)
    header["tensors"] = [["hidden", "float32", [1, 1, 4], "gzip"]]
    raw = msgpack.packb(header)
    with pytest.raises(ProtocolError, match="cannot travel in codec"):
        decode_frame(len(raw).to_bytes(4, "big") + raw + b"\0" * 200)


def test_a_client_sees_only_the_servers_that_take_its_codec():
    from corolla.client.swarm.routing import with_codec
    from corolla.protocol.messages import ServerInfo, ServerState

    def info(codecs):
        return ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=1, throughput=1.0, cache_tokens_total=8,
                          cache_tokens_free=8, torch_dtype="float32", version="0", protocol_version=4,
                          max_session_length=8, codecs=codecs)

    servers = [{"old": info(("none",)), "new": info(CODECS)}]
    assert with_codec(servers, "none") == servers
    assert list(with_codec(servers, "int8")[0]) == ["new"]
    assert ServerInfo.model_validate({k: v for k, v in info(CODECS).model_dump().items() if k != "codecs"}).codecs == ("none",)
