"""Tensor parallelism: each hosted block split over several devices, its partial outputs summed.

`corolla serve MODEL --tensor-parallel-devices cuda:0 cuda:1` keeps the span of blocks one server hosts, but
splits every block into one shard per device. The family decides how (attention by whole heads or KV-head
groups, the MLP by inner features): `corolla.models.llama.sharding` (Llama family, Mixtral),
`corolla.models.bloom.sharding`, `corolla.models.falcon.sharding`. A block runs as one or two residual stages:

    stage i, x (B, T, H) on devices[0]
      ├─► shard 0 on devices[0]: partial(i, x) ─┐
      ├─► shard 1 on devices[1]: partial(i, x) ─┼─► moved to devices[0], summed: x' = residual(i, x) + sum
      └─► ...                                  ─┘

    Llama, BLOOM, sequential Falcon: stage 0 is attention, stage 1 the MLP (pre-norm, one after the other)
    parallel Falcon (7B, 40B, 180B):  one stage, each shard's partial is its attention + MLP share

``residual(i, x)`` is ``x`` itself, except for BLOOM with ``apply_residual_connection_post_layernorm``
(the layer-normed x); shard 0 computes it. Row-parallel biases live in shard 0 only, so the partials sum to the
full block's branch output.

Each shard keeps the KV cache of its own KV heads on its own device, so a session's cache for one block is
one (k_cache, v_cache) pair per shard (`server.cache.kv.ShardedKV`, which a `tensor_parallel_stack` allocates):

    cache.kv(i) = ((k_0, v_0), (k_1, v_1), ...)     k_s, v_s: (B, n_kv_heads_s, S_max, head_dim) on devices[s]

Falcon-7B's single (multi-query) KV head cannot be split: every shard holds a copy of it and of its cache.

Shards run one after another from the one compute thread. On CUDA that still overlaps: kernels are queued
asynchronously on each device, and only the sum waits for the partials. On CPU ("cpu cpu") the shards share
the same cores, so it is a correctness path with no speedup: the same code as on GPUs, measurable here.

LoRA adapters (``--adapters``) are sliced per shard like the weights they update: see
``corolla.server.compute.tensor_parallel_lora``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.bloom.sharding import check_bloom_shardable, shard_bloom_block
from corolla.models.falcon.sharding import check_falcon_shardable, shard_falcon_block
from corolla.models.llama.sharding import (
    LinearSlice,
    check_shardable,
    shard_llama_block,
)
from corolla.models.ragged import RaggedKV
from corolla.models.registry import ModelFamily
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.cache.kv import ShardedKV
from corolla.models.quantization import check_quant_mode, quantize_block

logger = logging.getLogger(__name__)

ShardKV = tuple[Tensor, Tensor] | RaggedKV  # what one shard's block takes as its cache
ShardPairs = tuple[tuple[Tensor, Tensor], ...]  # one block's session cache: a (k_cache, v_cache) pair per shard


class BlockShard(Protocol):
    """What every family's shard provides (``LlamaShard``, ``BloomShard``, ``FalconShard``); see the module
    docstring."""

    n_kv_heads: int  # KV heads this shard caches
    head_dim: int
    num_stages: int  # residual stages of the block: 2 (attention, then MLP) or 1 (both in parallel)
    linear_slices: dict[str, LinearSlice]  # full block's linear layer path -> the part this shard holds (for LoRA)

    def residual(self, stage: int, hidden: Tensor) -> Tensor:
        """hidden (B, T, H) -> what stage ``stage``'s partials are added to (B, T, H); only shard 0's is used."""
        ...

    def partial(self, stage: int, hidden: Tensor, kv: ShardKV | None, position: int) -> Tensor:
        """hidden (B, T, H) -> this shard's additive share (B, T, H) of stage ``stage``'s branch output."""
        ...


# family name -> (check(config, num_shards), shard(block, config, num_shards) -> shards)
_SHARDERS: dict[str, tuple[Callable[[PretrainedConfig, int], None], Callable[..., list]]] = {
    "llama": (check_shardable, shard_llama_block),
    "mixtral": (check_shardable, shard_llama_block),
    "bloom": (check_bloom_shardable, shard_bloom_block),
    "falcon": (check_falcon_shardable, shard_falcon_block),
}


def check_tensor_parallel(family: ModelFamily, config: PretrainedConfig, devices: Sequence[str]) -> None:
    """Raise ``ValueError`` unless blocks of this family and config can be split over ``devices``.

    Called at server startup, before anything is loaded or announced.
    """
    if family.name not in _SHARDERS:
        raise ValueError(
            f"tensor parallelism is not supported for {family.name} yet; supported families: "
            f"{', '.join(sorted(_SHARDERS))}"
        )
    _SHARDERS[family.name][0](config, len(devices))


class TensorParallelBlock(nn.Module):
    """One block as N shards on N devices; same forward contract as the family block, except the cache.

    ``forward(hidden, kv, position)``: ``hidden`` (B, T, H) on any device, output (B, T, H) on ``devices[0]``.
    ``kv`` is ``None`` (no cache) or a sequence with one entry per shard, each what a block takes for its own
    heads: a ``(k_cache, v_cache)`` pair on the shard's device (see ``allocate_kv``) or a ``RaggedKV`` of the
    rows' caches of that shard (batched decode).
    """

    def __init__(self, shards: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        super().__init__()
        if len(shards) != len(devices) or not shards:
            raise ValueError(f"{len(shards)} shards for {len(devices)} devices")
        self.num_stages = shards[0].num_stages
        self.shards = nn.ModuleList(_placed(shard, torch.device(device)) for shard, device in zip(shards, devices))
        self.devices = [torch.device(d) for d in devices]

    def allocate_kv(self, batch_size: int, max_length: int, dtype: torch.dtype) -> ShardPairs:
        """Zeroed caches, per shard (B, n_kv_heads_s, max_length, head_dim) keys and values on its device."""
        pairs = []
        for shard, device in zip(self.shards, self.devices):
            shape = (batch_size, shard.n_kv_heads, max_length, shard.head_dim)
            pairs.append(
                (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            )
        return tuple(pairs)

    def _per_shard(self, kv: Sequence[ShardKV] | None) -> list[ShardKV | None]:
        if kv is None:
            return [None] * len(self.shards)
        if isinstance(kv, RaggedKV) or len(kv) != len(self.shards) or isinstance(kv[0], Tensor):
            raise ValueError(
                f"a tensor-parallel block takes one KV cache per shard ({len(self.shards)}), got {type(kv).__name__}"
            )
        return list(kv)

    def _sum(self, partials: list[Tensor]) -> Tensor:
        """The partials, each (B, T, H) on its shard's device, summed on devices[0] in shard order."""
        total = partials[0].to(self.devices[0])
        for partial in partials[1:]:
            total = total + partial.to(self.devices[0])
        return total

    def forward(self, hidden: Tensor, kv: Sequence[ShardKV] | None = None, position: int = 0) -> Tensor:
        """Run the block on ``hidden`` (B, T, H); returns (B, T, H) on devices[0]. Cache semantics as the family
        block's.

        Raises ``ValueError`` for a negative position or a cache that is not one entry per shard (and whatever the
        shard blocks raise for a cache that does not fit).
        """
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        kvs = self._per_shard(kv)
        hidden = hidden.to(self.devices[0])
        for stage in range(self.num_stages):
            # every shard's work is queued before any partial is gathered, so devices compute side by side
            partials = [
                shard.partial(stage, hidden.to(device), kv_s, position)
                for shard, device, kv_s in zip(self.shards, self.devices, kvs)
            ]
            hidden = self.shards[0].residual(stage, hidden) + self._sum(partials)  # (B, T, H)
        return hidden


def _placed(shard: nn.Module, device: torch.device) -> nn.Module:
    """``shard`` on ``device``; one already there (e.g. quantized on its way) is not moved again, since moving
    bitsandbytes weights through ``Module.to`` can leave their scales behind."""
    tensors = itertools.chain(shard.parameters(), shard.buffers())
    if all(t.device == device or (device.index is None and t.device.type == device.type) for t in tensors):
        return shard
    return shard.to(device)


def tensor_parallel_stack(
    blocks: list[TensorParallelBlock],
    start: int,
    hidden_size: int,
    layout: KVLayout,
    dtype: torch.dtype,
    max_chunk_tokens: int = 2048,
) -> BlockStack:
    """A `BlockStack` of `TensorParallelBlock`s, on their first device, whose session caches are per shard
    (`ShardedKV`).

    ``layout`` is the family's per-block KV layout; the stack's own counts every shard's KV heads, so cache memory
    accounting includes the copies of a replicated KV head (Falcon multi-query).
    """
    layout = KVLayout(sum(shard.n_kv_heads for shard in blocks[0].shards), layout.head_dim)
    return BlockStack(
        blocks, start, hidden_size, layout, dtype, blocks[0].devices[0], max_chunk_tokens, cache=ShardedKV
    )


def build_tensor_parallel_block(
    family: ModelFamily, config: PretrainedConfig, block: nn.Module, devices: Sequence[str], quant: str = "none"
) -> TensorParallelBlock:
    """Split a loaded full block (on any device, typically the CPU it was loaded on) over ``devices``, each shard
    quantized (``quant``: int8, nf4) on its way to its device, in the block's dtype.

    Raises ``ValueError`` as ``check_tensor_parallel`` does, or for an unknown quantization.
    """
    check_tensor_parallel(family, config, devices)
    check_quant_mode(quant)
    dtype = next(block.parameters()).dtype
    shards = _SHARDERS[family.name][1](block, config, len(devices))
    placed = [quantize_block(shard, quant, device, dtype) for shard, device in zip(shards, devices)]
    return TensorParallelBlock(placed, [torch.device(d) for d in devices])


def measure_throughput(stack: BlockStack, steps: int = 20) -> float:
    """Single-token decode steps per second through the first block of a `tensor_parallel_stack` (median of
    ``steps`` timed runs)."""
    cache = stack.allocate_cache(1, steps + 4, stack.start, stack.start + 1)
    x = torch.randn(1, 1, stack.hidden_size, dtype=stack.dtype, device=stack.device)
    times = []
    with torch.inference_mode():
        for position in range(steps + 2):
            begin = time.perf_counter()
            stack.blocks[0](x, cache.kv(stack.start), position)
            for device in {d for d in stack.blocks[0].devices if d.type == "cuda"}:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
    times = sorted(times[2:])
    return 1.0 / max(times[len(times) // 2], 1e-6)
