"""The lossless "deflate" codec (protocol.codecs): bit-exact for every float dtype, fewer bytes on hidden states,
and a frame whose deflated tensor is not what it says is a ProtocolError, never a large allocation; the client uses
it for its steps of many positions only where the server takes it (protocol.codecs.bulk_codec)."""

from __future__ import annotations

import zlib

import pytest
import torch

from corolla.client.chain.span_session import bulk_accepted
from corolla.client.config import ClientConfig
from corolla.client.swarm.routing import with_codec
from corolla.protocol.codecs import CODECS, DEFLATE_PREFIX, bulk_codec, decode, encode, encoded_bytes
from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import decode_frame, encode_frame
from corolla.protocol.messages import InferenceStep, ServerInfo, ServerState

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def hidden_states(dtype: torch.dtype, tokens: int = 64, width: int = 256) -> torch.Tensor:
    """Residual-stream-like values: rows of different scales, an outlier feature."""
    torch.manual_seed(1)
    x = torch.randn(2, tokens, width) * torch.rand(2, tokens, 1) * 4
    x[:, :, 7] *= 30
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_bit_comes_back_even_nan_inf_and_negative_zero(dtype):
    x = hidden_states(dtype)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    y = decode("deflate", encode("deflate", x), list(x.shape), dtype)
    assert y.dtype == dtype and torch.equal(y.view(INT_VIEW[dtype]), x.view(INT_VIEW[dtype]))


@pytest.mark.parametrize("dtype, at_most", [(torch.float32, 0.92), (torch.bfloat16, 0.8)])
def test_hidden_states_take_fewer_bytes(dtype, at_most):
    x = hidden_states(dtype, tokens=256)
    raw = encode("deflate", x)
    assert len(raw) <= at_most * x.numel() * x.element_size()
    assert len(raw) <= encoded_bytes("deflate", x.shape, dtype)  # the bound sizing code relies on


def test_values_no_compressor_can_shrink_stay_within_the_bound():
    x = torch.randint(-(2**31), 2**31 - 1, (3, 1000), dtype=torch.int32).view(torch.float32)  # every bit random
    raw = encode("deflate", x)
    assert len(raw) <= encoded_bytes("deflate", x.shape, x.dtype)
    assert torch.equal(decode("deflate", raw, [3, 1000], torch.float32).view(torch.int32), x.view(torch.int32))


def frame_with(data: bytes, shape: list[int]) -> bytes:
    """A frame whose hidden tensor (float32 of `shape`) claims to be deflated into `data`."""
    good = encode_frame(InferenceStep(step_id=1, position=0), {"hidden": torch.zeros(shape)}, "deflate")
    real = encode("deflate", torch.zeros(shape))
    assert good.endswith(real)
    return good[: len(good) - len(real)] + data


def test_a_deflated_tensor_that_is_not_what_it_says_is_a_protocol_error():
    shape = [1, 8, 16]
    n = 8 * 16
    rest = bytes(3 * n)
    for label, data in {
        "corrupt": (10).to_bytes(DEFLATE_PREFIX, "big") + b"\xff" * 10 + rest,
        "inflates to too few bytes": _deflated(bytes(n - 1)) + rest,
        "inflates past its values": _deflated(bytes(n + 1)) + rest,
        "trailing bytes inside": _deflated(bytes(n), extra=b"junk") + rest,
        "mantissa bytes missing": _deflated(bytes(n)) + rest[:-1],
        "prefix cut": b"\0\0",
    }.items():
        with pytest.raises(ProtocolError):
            decode_frame(frame_with(data, shape))
            pytest.fail(label)
    assert decode_frame(frame_with(_deflated(bytes(n)) + rest, shape))[1]["hidden"].abs().sum() == 0


def test_a_small_frame_cannot_inflate_into_a_large_tensor():
    shape = [1, 4096, 256]  # 4 MiB of float32 claimed
    n = 4096 * 256
    top = zlib.compress(bytes(n), 9)  # ~1 KiB of zeros that inflate to 1 MiB ...
    frame = frame_with(len(top).to_bytes(DEFLATE_PREFIX, "big") + top, shape)  # ... but no mantissa bytes
    assert len(frame) < 8192
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frame(frame)
    with pytest.raises(ProtocolError, match="past the limit"):
        decode_frame(frame_with(len(top).to_bytes(DEFLATE_PREFIX, "big") + top + bytes(3 * n), shape),
                     max_bytes=(1 << 22) - 1)


def _deflated(top: bytes, extra: bytes = b"") -> bytes:
    data = zlib.compress(top, 1) + extra
    return len(data).to_bytes(DEFLATE_PREFIX, "big") + data


def info(codecs: tuple[str, ...]) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=1, throughput=1.0, cache_tokens_total=8,
                      cache_tokens_free=8, torch_dtype="float32", version="0", protocol_version=4,
                      max_session_length=8, codecs=codecs)


def test_a_server_announcing_a_codec_this_version_does_not_know_is_still_seen():
    later = info(("none", "zstd-9000"))
    assert ServerInfo.model_validate(later.model_dump()).codecs == ("none", "zstd-9000")
    assert with_codec([{"later": later}], "none") == [{"later": later}]
    assert with_codec([{"later": later}], "int8") == [{}]
    with pytest.raises(ValueError):
        info(("x" * 17,))


def test_the_client_deflates_its_bulk_steps_only_where_the_server_takes_it_and_nothing_is_lost():
    def chosen(config: ClientConfig, server: ServerInfo | None, positions: int = 48) -> str:
        return bulk_codec(config.compression, positions, bulk_accepted(config, server))

    assert chosen(ClientConfig(), info(CODECS)) == "deflate"
    assert chosen(ClientConfig(), info(CODECS), positions=1) == "none"  # a decode step: a few KiB either way
    assert chosen(ClientConfig(), info(("none",))) == "none"  # a server that predates it
    assert chosen(ClientConfig(), None) == "none"  # not in the view at hand
    assert chosen(ClientConfig(deflate_bulk=False), info(CODECS)) == "none"
    assert chosen(ClientConfig(compression="int8"), info(CODECS)) == "int8"  # already small, and lossy
