"""Which of our model families serves a given HF config.

To add a family: implement its package (block, head, checkpoint naming) and append one ``ModelFamily``
to ``FAMILIES`` below. Each HF ``model_type`` may belong to one family only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models import bloom, falcon, llama, mixtral

logger = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The config's ``model_type`` has no family here; the message lists the supported ones."""


@dataclass(frozen=True)
class ModelFamily:
    """Everything the server and client need to run one family's checkpoints."""

    name: str  # family name, e.g. "llama"
    model_types: tuple[str, ...]  # HF config.model_type values this family serves
    block_class: type[nn.Module]  # block_class(config, layer_idx): one served transformer block
    head_class: type[nn.Module]  # head_class(config): client-side embeddings, final norm, LM head
    block_prefix: Callable[[int], str]  # block i's checkpoint-name prefix, e.g. "model.layers.3."
    is_head_tensor: Callable[[str], bool]  # True for the checkpoint names the client loads
    kv_layout: Callable[[PretrainedConfig], tuple[int, int]]  # (n_kv_heads, head_dim) of one block's cache
    num_blocks: Callable[[PretrainedConfig], int]  # number of transformer blocks
    # stored checkpoint name -> the name block_prefix/is_head_tensor use (checkpoints of one family may differ)
    canonical_name: Callable[[str], str] = lambda name: name

    def block_tensors(self, tensors: Mapping[str, Tensor], index: int) -> dict[str, Tensor]:
        """Block ``index``'s tensors out of checkpoint tensors under canonical names, with the block prefix stripped."""
        prefix = self.block_prefix(index)
        return {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}

    def load_block(self, config: PretrainedConfig, index: int, tensors: Mapping[str, Tensor]) -> nn.Module:
        """Block ``index`` built (in the default dtype) and loaded from checkpoint tensors under canonical names."""
        block = self.block_class(config, index)
        block.load_hf_state_dict(self.block_tensors(tensors, index))
        return block


LLAMA = ModelFamily(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    block_class=llama.LlamaBlock,
    head_class=llama.LlamaClientHead,
    block_prefix=llama.block_prefix,
    is_head_tensor=llama.is_head_tensor,
    kv_layout=llama.kv_layout,
    num_blocks=llama.num_blocks,
)

BLOOM = ModelFamily(
    name="bloom",
    model_types=("bloom",),
    block_class=bloom.BloomBlock,
    head_class=bloom.BloomClientHead,
    block_prefix=bloom.block_prefix,
    is_head_tensor=bloom.is_head_tensor,
    kv_layout=bloom.kv_layout,
    num_blocks=bloom.num_blocks,
    canonical_name=bloom.canonical_name,  # hub checkpoints omit the "transformer." prefix
)

FALCON = ModelFamily(
    name="falcon",
    model_types=("falcon",),
    block_class=falcon.FalconBlock,
    head_class=falcon.FalconClientHead,
    block_prefix=falcon.block_prefix,
    is_head_tensor=falcon.is_head_tensor,
    kv_layout=falcon.kv_layout,
    num_blocks=falcon.num_blocks,
)

MIXTRAL = ModelFamily(
    name="mixtral",
    model_types=("mixtral",),
    block_class=mixtral.MixtralBlock,
    head_class=llama.LlamaClientHead,  # embeddings, final norm and LM head are exactly Llama's
    block_prefix=mixtral.block_prefix,
    is_head_tensor=mixtral.is_head_tensor,
    kv_layout=mixtral.kv_layout,
    num_blocks=mixtral.num_blocks,
)

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, BLOOM, FALCON, MIXTRAL)


def _by_model_type(families: tuple[ModelFamily, ...]) -> dict[str, ModelFamily]:
    """model_type -> family; a model_type claimed twice is a programming error."""
    table: dict[str, ModelFamily] = {}
    for family in families:
        for model_type in family.model_types:
            assert model_type not in table, f"model_type {model_type!r} registered twice"
            table[model_type] = family
    return table


_BY_MODEL_TYPE: dict[str, ModelFamily] = _by_model_type(FAMILIES)


def supported_model_types() -> tuple[str, ...]:
    """All HF ``model_type`` values some family serves, sorted."""
    return tuple(sorted(_BY_MODEL_TYPE))


def get_family(config: PretrainedConfig) -> ModelFamily:
    """The family serving ``config.model_type``.

    Raises ``UnsupportedModelError`` (a ``ValueError``) naming the model_type and listing the supported ones.
    """
    model_type = getattr(config, "model_type", None) or ""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())}"
        )
    return family
