"""LoRA adapters on tensor-parallel blocks: each shard gets the slice of the update that matches its weights.

A LoRA update of a full linear layer is ``dW = scale * B @ A`` (A (r, in), B (out, r)). A shard holding part of
the layer (its ``LinearSlice``, recorded by the family sharder) gets the same part of the update:

    column-parallel, output rows I:   LoraWeights(A, B[I])       its outputs are its own rows of the layer's
    row-parallel, input columns J:    LoraWeights(A[:, J], B)    summed over shards:
                                      sum_s B (A[:, J_s] x[J_s]) = B A x, the full update, counted once
    replicated, output not summed:    LoraWeights(A, B)          (Mixtral's router) each shard's copy is whole

A replicated linear whose output IS summed over shards would count the update once per shard; the sharders give
such a layer no ``LinearSlice`` (none exists in our families), so an adapter targeting it is refused here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from corolla.models.llama.sharding import LinearSlice
from corolla.models.lora import LoraWeights, attach_lora, check_lora_shapes
from corolla.server.compute.tensor_parallel import TensorParallelBlock

logger = logging.getLogger(__name__)


def slice_lora(weights: LoraWeights, part: LinearSlice) -> LoraWeights:
    """The part of ``weights`` (an update of the full layer) that goes with a shard holding ``part`` of the layer."""
    if part.dim is None:
        return weights
    index = part.index.to(weights.A.device)
    if part.dim == 0:
        return LoraWeights(weights.A, weights.B.index_select(0, index), weights.scale)  # B (len(I), r)
    return LoraWeights(weights.A.index_select(1, index), weights.B, weights.scale)  # A (r, len(J))


def attach_tensor_parallel_lora(block: TensorParallelBlock, name: str, updates: Mapping[str, LoraWeights],
                                dtype: torch.dtype) -> None:
    """Attach adapter ``name`` (full-block layer path -> update of the full layer, e.g. ``"mlp.down_proj"``) to
    every shard of ``block``, each shard's slice in ``dtype`` on the shard's device.

    Raises ``ValueError`` naming the layer when the shards cannot split it (not a linear layer of the block, or
    one with no known split) or when the update's shapes do not fit the full layer; every layer is checked
    before any shard is changed (and ``attach_lora`` checks a whole shard before changing it, the first shard
    first, so a layer already holding ``name`` is refused before anything changes either).
    """
    per_shard: list[dict[str, LoraWeights]] = [{} for _ in block.shards]
    for path in sorted(updates):
        parts = [shard.linear_slices.get(path) for shard in block.shards]
        if any(part is None for part in parts):
            known = sorted(block.shards[0].linear_slices)
            raise ValueError(
                f"adapter {name!r} targets {path!r}, which tensor-parallel shards of this block cannot split (not a "
                f"linear layer, or one whose replicated output would be summed over shards); layers that can take "
                f"an adapter with tensor parallelism: {known}"
            )
        out_features, in_features = parts[0].full_shape
        check_lora_shapes(updates[path], in_features, out_features, f"adapter {name!r} at {path}")
        for s, part in enumerate(parts):
            per_shard[s][part.path] = slice_lora(updates[path], part)
    for shard, device, shard_updates in zip(block.shards, block.devices, per_shard, strict=True):
        attach_lora(shard, name, shard_updates, dtype, device)
    logger.debug("lora.attached_tensor_parallel adapter=%s layers=%d shards=%d", name, len(updates), len(block.shards))
