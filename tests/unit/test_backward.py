"""Backward through blocks (server math) and chunked, re-routed backward passes (client logic), without a swarm.

The server's `BlockStack.backward` is checked against plain torch autograd of the same blocks; the client's
`RemoteBlocks` runs over a fake transport that computes each span with local blocks, so chunking and re-routing
can be compared exactly with one local autograd pass.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaConfig

from corolla.client.config import ClientConfig
from corolla.client.swarm.remote_blocks import RemoteBlocks, chunk_sizes
from corolla.client.swarm.routing import Span
from corolla.models.llama import LlamaBlock
from corolla.protocol.errors import PeerUnavailable
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.compute.forward_backward import (
    add_prompt,
    check_grad_output,
    check_prompts,
    run_blocks,
)

H = 32


def make_blocks(n: int = 3) -> list[LlamaBlock]:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=n, vocab_size=16)
    blocks = []
    for i in range(n):
        block = LlamaBlock(config, i).eval()
        for p in block.parameters():  # larger than init, so attention is far from uniform
            p.data.normal_(0, 0.2)
        blocks.append(block.requires_grad_(False))
    return blocks


def make_stack(blocks, start: int = 0) -> BlockStack:
    return BlockStack(blocks, start, H, KVLayout(2, H // 4), torch.float32, torch.device("cpu"))


def reference_grads(blocks, hidden, grad_output, prompts=None):
    """Plain autograd of the same computation, written out here: prompts[j] added to [0, P) before blocks[j]."""
    x0 = hidden.clone().requires_grad_(True)
    p = prompts.clone().requires_grad_(True) if prompts is not None else None
    x = x0
    for j, block in enumerate(blocks):
        if p is not None:
            pad = torch.zeros(x.shape[1] - p.shape[1], H)
            x = x + torch.cat([p[j], pad])[None]
        x = block(x)
    x.backward(grad_output)
    return x.detach(), x0.grad, (None if p is None else p.grad)


def test_chunk_sizes_split_the_batch_under_the_byte_limit():
    assert chunk_sizes(5, row_bytes=100, max_bytes=250) == [2, 2, 1]
    assert chunk_sizes(4, row_bytes=100, max_bytes=400) == [4]
    assert chunk_sizes(3, row_bytes=100, max_bytes=10) == [1, 1, 1]  # one row at least, even past the limit
    assert chunk_sizes(7, row_bytes=1, max_bytes=1 << 20) == [7]


def test_block_stack_backward_equals_torch_autograd_of_the_same_blocks():
    blocks = make_blocks(3)
    stack = make_stack(blocks, start=5)
    torch.manual_seed(1)
    hidden, grad_out = torch.randn(2, 7, H), torch.randn(2, 7, H)
    with torch.inference_mode():  # the compute thread may be in inference mode; backward must not care
        grad_hidden, grad_prompts = stack.backward(hidden, grad_out, 6, 8)
    _, expected, _ = reference_grads(blocks[1:3], hidden, grad_out)
    assert grad_prompts is None
    assert torch.allclose(grad_hidden, expected, atol=1e-5, rtol=0)
    assert all(p.grad is None for b in blocks for p in b.parameters())  # frozen weights get nothing


def test_block_stack_backward_with_deep_prompts_equals_torch_autograd():
    blocks = make_blocks(3)
    stack = make_stack(blocks)
    torch.manual_seed(2)
    hidden, grad_out, prompts = torch.randn(3, 6, H), torch.randn(3, 6, H), torch.randn(3, 2, H)
    out_ref, grad_ref, prompt_grad_ref = reference_grads(blocks, hidden, grad_out, prompts)
    assert torch.allclose(stack.forward(hidden, 0, 3, prompts), out_ref, atol=1e-5, rtol=0)
    grad_hidden, grad_prompts = stack.backward(hidden, grad_out, 0, 3, prompts)
    assert torch.allclose(grad_hidden, grad_ref, atol=1e-5, rtol=0)
    assert torch.allclose(grad_prompts, prompt_grad_ref, atol=1e-5, rtol=0)
    zero = torch.zeros(3, 2, H)
    assert torch.allclose(stack.forward(hidden, 0, 3, zero), stack.forward(hidden, 0, 3), atol=1e-6, rtol=0)


def test_add_prompt_touches_only_the_prompt_positions():
    hidden, prompt = torch.zeros(2, 5, 3), torch.ones(2, 3)
    out = add_prompt(hidden, prompt)
    assert out[:, :2].eq(1).all() and out[:, 2:].eq(0).all()


def test_add_prompt_at_a_later_position_adds_only_the_prompt_rows_that_chunk_holds():
    prompt = torch.arange(4.0)[:, None].expand(4, 3)  # (P=4, H=3): row p holds p
    out = add_prompt(torch.zeros(1, 3, 3), prompt, position=2)  # the chunk holds positions 2, 3, 4
    assert out[0, :, 0].tolist() == [2.0, 3.0, 0.0]
    past = torch.zeros(1, 2, 3)
    assert add_prompt(past, prompt, position=4) is past  # past the prompt: nothing to add
    assert add_prompt(torch.zeros(1, 2, 3), prompt, position=1)[0, :, 0].tolist() == [1.0, 2.0]


def test_bad_backward_tensors_are_refused_with_clear_messages():
    hidden = torch.randn(2, 4, H)
    with pytest.raises(ValueError, match="grad_output has shape"):
        check_grad_output(torch.randn(2, 3, H), hidden)
    with pytest.raises(ValueError, match="float32"):
        check_grad_output(torch.ones(2, 4, H, dtype=torch.int64), hidden)
    with pytest.raises(ValueError, match="NaN"):
        check_grad_output(torch.full((2, 4, H), float("nan")), hidden)
    with pytest.raises(ValueError, match=r"prompts must have shape \(2, P, 32\)"):
        check_prompts(torch.randn(3, 2, H), hidden, num_blocks=2)
    with pytest.raises(ValueError, match="between 1 and the sequence length 4"):
        check_prompts(torch.randn(2, 5, H), hidden, num_blocks=2)
    with pytest.raises(ValueError, match="between 1 and the session's max_length 8"):
        check_prompts(torch.randn(2, 9, H), hidden, num_blocks=2, max_positions=8)
    assert check_prompts(torch.randn(2, 8, H), hidden, num_blocks=2, max_positions=8).shape == (2, 8, H)


# ---------------------------------------------------------------------- client: chunks and re-routing
class FakeManager:
    """Routes from a fixed list of servers; records bans. Each server holds blocks [a, b) of the local model."""

    def __init__(self, servers: dict[str, tuple[int, int]], max_chunk_bytes: int):
        self.servers = servers
        self.config = ClientConfig(max_chunk_bytes=max_chunk_bytes, max_retries=3)
        self.banned: list[str] = []

    async def make_forward_route(self, start: int, end: int) -> list[Span]:
        route, block = [], start
        while block < end:
            peer, (_, b) = next((p, r) for p, r in self.servers.items() if r[0] <= block < r[1] and p not in self.banned)
            route.append(Span(peer, block, min(b, end)))
            block = min(b, end)
        return route

    def after_failure(self, error: Exception, failures: int, span: Span) -> int:
        self.banned.append(span.peer_id)
        return failures + 1

    async def backoff(self, failures: int) -> None:
        pass

    def forgive(self, peer_id: str) -> None:
        pass

    def observe(self, peer_id: str, seconds: float, blocks: int, tokens: int) -> None:
        pass


class LocalBlocks(RemoteBlocks):
    """RemoteBlocks whose requests run on local blocks; `broken` peers fail their backward requests."""

    def __init__(self, manager, blocks, broken=()):
        super().__init__(manager, 0, len(blocks))
        self.blocks, self.broken, self.calls, self.masks = blocks, set(broken), [], []

    async def forward_span(self, span, hidden, prompts, mask=None):
        self.calls.append(("forward", span.peer_id, hidden.shape[0]))
        self.masks.append(mask)
        with torch.no_grad():
            return run_blocks(self.blocks[span.start : span.end], hidden, prompts, mask)

    async def backward_span(self, span, hidden, grad, prompts, mask=None):
        self.calls.append(("backward", span.peer_id, hidden.shape[0]))
        self.masks.append(mask)
        if span.peer_id in self.broken:
            raise PeerUnavailable(f"{span.peer_id} is gone")
        return make_stack(self.blocks[span.start : span.end]).backward(hidden, grad, 0, span.end - span.start, prompts, mask)


def run_remote(remote: RemoteBlocks, hidden, grad_out, prompts, mask=None):
    async def go():
        out, chunks = await remote.forward(hidden, prompts, mask)
        return out, await remote.backward(chunks, grad_out, prompts)

    return asyncio.run(go())


def test_chunked_forward_and_backward_equal_one_local_autograd_pass():
    blocks = make_blocks(4)
    torch.manual_seed(3)
    hidden, grad_out, prompts = torch.randn(5, 6, H), torch.randn(5, 6, H), torch.randn(4, 2, H)
    row_bytes = 6 * H * 4
    manager = FakeManager({"a": (0, 2), "b": (2, 4)}, max_chunk_bytes=2 * row_bytes)  # chunks of 2, 2, 1 rows
    remote = LocalBlocks(manager, blocks)
    out, (grad_hidden, grad_prompts) = run_remote(remote, hidden, grad_out, prompts)
    out_ref, grad_ref, prompt_grad_ref = reference_grads(blocks, hidden, grad_out, prompts)
    assert sorted(n for kind, peer, n in remote.calls if kind == "backward" and peer == "a") == [1, 2, 2]
    assert torch.allclose(out, out_ref, atol=1e-5, rtol=0)
    assert torch.allclose(grad_hidden, grad_ref, atol=1e-5, rtol=0)
    assert torch.allclose(grad_prompts, prompt_grad_ref, atol=1e-5, rtol=0)


def test_backward_reroutes_a_failed_span_through_replacement_servers():
    blocks = make_blocks(4)
    torch.manual_seed(4)
    hidden, grad_out, prompts = torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(4, 1, H)
    # "big" serves everything and is used for the forward; it dies before backward, "x" and "y" replace it.
    manager = FakeManager({"big": (0, 4), "x": (0, 3), "y": (3, 4)}, max_chunk_bytes=1 << 20)
    remote = LocalBlocks(manager, blocks, broken={"big"})
    out, (grad_hidden, grad_prompts) = run_remote(remote, hidden, grad_out, prompts)
    out_ref, grad_ref, prompt_grad_ref = reference_grads(blocks, hidden, grad_out, prompts)
    assert torch.allclose(out, out_ref, atol=1e-5, rtol=0)
    assert manager.banned == ["big"]
    assert [c[:2] for c in remote.calls] == [("forward", "big"), ("backward", "big"), ("forward", "x"),
                                             ("backward", "y"), ("backward", "x")]
    assert torch.allclose(grad_hidden, grad_ref, atol=1e-5, rtol=0)
    assert torch.allclose(grad_prompts, prompt_grad_ref, atol=1e-5, rtol=0)


def test_a_padded_batch_sends_each_chunk_its_rows_of_the_mask_also_after_rerouting():
    blocks = make_blocks(4)
    torch.manual_seed(5)
    hidden, grad_out, prompts = torch.randn(3, 5, H), torch.randn(3, 5, H), torch.randn(4, 1, H)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 1, 1], [1, 1, 0, 0, 1]], dtype=torch.bool)  # prompt slot 0 real
    manager = FakeManager({"big": (0, 4), "x": (0, 3), "y": (3, 4)}, max_chunk_bytes=2 * 5 * H * 4)  # chunks 2, 1
    remote = LocalBlocks(manager, blocks, broken={"big"})
    out, (grad_hidden, grad_prompts) = run_remote(remote, hidden, grad_out, prompts, mask)
    assert all(m is not None and m.shape[0] == n for m, (_, _, n) in zip(remote.masks, remote.calls))  # rows of the mask
    prompt_grad_ref = torch.zeros_like(prompts)
    for row in range(3):  # each row as if alone, on its real slots
        real = mask[row]
        out_ref, grad_ref, row_prompt_grad = reference_grads(blocks, hidden[row : row + 1, real], grad_out[row : row + 1, real], prompts)
        assert torch.allclose(out[row, real], out_ref[0], atol=1e-5, rtol=0)
        assert torch.allclose(grad_hidden[row, real], grad_ref[0], atol=1e-5, rtol=0)
        prompt_grad_ref += row_prompt_grad
    assert torch.equal(out[~mask], hidden[~mask]) and torch.equal(grad_hidden[~mask], grad_out[~mask])
    assert torch.allclose(grad_prompts, prompt_grad_ref, atol=1e-5, rtol=0)
    assert manager.banned == ["big", "big"]  # each chunk found it gone
