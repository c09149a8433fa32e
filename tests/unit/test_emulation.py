"""Computing a span as another kind of server (server.compute.emulation): a float32 server asked to compute as int8, nf4 or
bfloat16 gives exactly what a server loaded that way gives, and servers that cannot emulate say so."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from corolla.models.llama.block import LlamaBlock
from corolla.models.quantization import block_as_kind, quantize_block
from corolla.protocol.messages import ComputeKind, QuantMode
from corolla.server.compute.forward_backward import run_blocks
from corolla.server.compute.emulation import Emulator

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=3, vocab_size=16)


def blocks() -> list[LlamaBlock]:
    torch.manual_seed(0)
    return [LlamaBlock(CONFIG, i).eval().requires_grad_(False) for i in range(3)]


@pytest.mark.parametrize("dtype, quant", [("float32", "int8"), ("float32", "nf4"), ("bfloat16", "none"),
                                          ("bfloat16", "nf4")])
def test_an_emulated_span_equals_a_server_loaded_as_that_kind(dtype, quant):
    floats = blocks()
    torch_dtype = getattr(torch, dtype)
    served = [quantize_block(b.to(torch_dtype), quant, "cpu", torch_dtype).eval() for b in blocks()]
    hidden = torch.randn(2, 5, 64)
    with torch.inference_mode():
        expected = run_blocks(served[1:3], hidden.to(torch_dtype)).float()
    emulator = Emulator(floats, 0, ComputeKind(dtype="float32"), torch.device("cpu"), enabled=True)
    kind = ComputeKind(dtype=dtype, quant=QuantMode(quant))
    assert emulator.problem(kind) is None
    got = emulator.forward(hidden, 1, 3, kind)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    with torch.inference_mode():
        plain = run_blocks(floats[1:3], hidden)
    assert not torch.equal(got, plain)  # the kind matters, and the float blocks were not changed in place
    assert torch.equal(plain, run_blocks(blocks()[1:3], hidden))


def test_only_float32_servers_without_adapters_can_emulate_other_kinds():
    nf4 = ComputeKind(dtype="float32", quant=QuantMode.NF4)
    assert Emulator(blocks(), 0, ComputeKind(dtype="float32"), torch.device("cpu"), enabled=False).problem(nf4)
    half = Emulator(blocks(), 0, ComputeKind(dtype="bfloat16"), torch.device("cpu"), enabled=True)
    assert "cannot compute as float32/nf4" in half.problem(nf4)
    assert half.problem(ComputeKind(dtype="bfloat16")) is None  # its own kind: a plain forward


def test_block_as_kind_leaves_the_float_block_alone():
    block = blocks()[0]
    before = {k: v.clone() for k, v in block.state_dict().items()}
    block_as_kind(block, torch.bfloat16, "int8")
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
