"""Which backend serves a given HF config: one of our own block families, or the generic backend.

Our own blocks (``FAMILIES``) are the fast path for the model types they cover. Every other decoder-only
``model_type`` goes to the generic backend (models.generic: the installed transformers' own decoder layers on our
caches) when its layers fit, and gets ``UnsupportedModelError`` naming what does not fit otherwise. Setting the
environment variable ``COROLLA_BACKEND=generic`` sends every model type to the generic backend, ours included (to
compare the two on one checkpoint; servers and clients with different backends interoperate, the wire format is
the same). This module is the only place that choice is made.

To add a family: implement its package (block, head, checkpoint naming) and append one ``ModelFamily``
to ``FAMILIES`` below. Each HF ``model_type`` may belong to one family only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models import bloom, falcon, llama, mixtral
from corolla.models.generic import (
    LAYER,
    GenericBlock,
    GenericClientHead,
    UnsupportedArchitecture,
    cache_length,
    inspect_architecture,
)

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
    # (config, block index, session max_length) -> positions that block's KV cache keeps for the session: fewer
    # than max_length for sliding-window layers that keep only a ring of recent positions (generic backend)
    cache_length: Callable[[PretrainedConfig, int, int], int] = lambda config, index, max_length: max_length

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


BACKEND_ENV = "COROLLA_BACKEND"  # "auto" (default): our own blocks where we have them; "generic": always generic
BACKENDS = ("auto", "generic")
GENERIC = "generic"  # the generic backend's family name
# Model types the generic backend is checked on against HF (tests/models/test_generic_models.py: every layer,
# whole-model logits, cached decoding, batched and ragged steps). Another type whose layers fit also runs, with a
# warning that it is unverified.
GENERIC_VERIFIED: tuple[str, ...] = (
    "cohere", "cohere2", "exaone4", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "gpt_oss", "granite", "helium",
    "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "phi3", "qwen2_moe", "qwen3_moe", "seed_oss", "smollm3",
    "stablelm", "starcoder2",
)


def _backend() -> str:
    backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}; choose one of {', '.join(BACKENDS)}")
    return backend


def generic_family(config: PretrainedConfig) -> ModelFamily:
    """The generic backend's ``ModelFamily`` for ``config``: its blocks run the checkpoint's own transformers decoder
    layers. Checkpoint names of block i gain ``layer.`` after the block prefix (``canonical_name``), because the
    block holds the HF layer as its child ``layer``. Raises ``UnsupportedArchitecture`` naming what does not fit."""
    arch = inspect_architecture(config)
    layer_name = re.compile(rf"^{re.escape(arch.layers_path)}\.\d+\.")

    def canonical_name(name: str) -> str:
        return layer_name.sub(lambda match: f"{match.group(0)}{LAYER}.", name, count=1)

    return ModelFamily(
        name=GENERIC,
        model_types=(arch.model_type,),
        block_class=GenericBlock,
        head_class=GenericClientHead,
        block_prefix=arch.block_prefix,
        is_head_tensor=arch.head.tensors.__contains__,
        kv_layout=lambda c: (inspect_architecture(c).n_kv_heads, inspect_architecture(c).head_dim),
        num_blocks=lambda c: inspect_architecture(c).num_layers,
        canonical_name=canonical_name,
        cache_length=lambda c, index, max_length: cache_length(
            inspect_architecture(c).windows[index], inspect_architecture(c).head_dim, max_length),
    )


def supported_model_types() -> tuple[str, ...]:
    """The HF ``model_type`` values our own blocks or the verified generic backend serve, sorted."""
    return tuple(sorted(set(_BY_MODEL_TYPE) | set(GENERIC_VERIFIED)))


def get_family(config: PretrainedConfig) -> ModelFamily:
    """The backend serving ``config.model_type``: our own family where we have one (unless ``COROLLA_BACKEND=generic``),
    else the generic backend.

    Raises ``UnsupportedModelError`` (a ``ValueError``) naming the model_type, why the generic backend cannot run it,
    and the supported model types.
    """
    model_type = getattr(config, "model_type", None) or ""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is not None and _backend() == "auto":
        return family
    try:
        generic = generic_family(config)
    except UnsupportedArchitecture as e:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported: our own blocks do not cover it and the generic backend "
            f"cannot run it ({'; '.join(e.reasons)}); supported model types: {', '.join(supported_model_types())}"
        ) from e
    if model_type not in GENERIC_VERIFIED and family is None:
        logger.warning("model_type %r runs on the generic backend, which corolla's tests have not checked for it",
                       model_type)
    return generic


# Model types the generic backend refuses, listed in the README with the reasons the code gives for them.
REFUSED_EXAMPLES: tuple[str, ...] = (
    "deepseek_v3", "falcon_h1", "gemma3n_text", "gpt2", "jamba", "lfm2", "llama4_text", "mamba", "qwen3_next", "t5",
)
_FAMILY_NOTES: dict[str, str] = {  # family name -> what our own block covers
    "llama": "our Llama-family block (GQA, rotary variants, Qwen biases and q/k norms, Mistral/Qwen sliding windows)",
    "bloom": "our BLOOM block (ALiBi; hub checkpoints with or without the `transformer.` prefix)",
    "falcon": "our Falcon block (7B multi-query and 40B/180B new decoder architecture; not ALiBi falcon-rw)",
    "mixtral": "our Mixtral block (sparse MoE; per-expert hub tensors or transformers' fused layout)",
}


def refusal_reason(model_type: str) -> str:
    """Why the generic backend refuses ``model_type``'s default config ("" if it does not)."""
    from transformers import AutoConfig

    try:
        inspect_architecture(AutoConfig.for_model(model_type))
    except UnsupportedArchitecture as e:
        return "; ".join(e.reasons)
    return ""


def models_table() -> str:
    """The README's list of supported models, generated from this module (``corolla models`` prints it): our own
    families, the model types the generic backend is checked on, and example refusals with their reasons."""
    lines = ["| backend | model types | blocks |", "|---|---|---|"]
    for family in FAMILIES:
        types = ", ".join(f"`{t}`" for t in family.model_types)
        lines.append(f"| `{family.name}` | {types} | {_FAMILY_NOTES[family.name]} |")
    verified = ", ".join(f"`{t}`" for t in GENERIC_VERIFIED)
    lines.append(f"| `{GENERIC}` | {verified} | the installed transformers' own decoder layers, checked against HF |")
    lines.append(f"| `{GENERIC}` | any other decoder-only type whose layers fit | the same, unverified (a warning at "
                 "load) |")
    lines += ["", "Refused (the reasons are the code's own, `corolla models` prints them for the installed "
              "transformers):", ""]
    lines += [f"- `{t}`: {refusal_reason(t)}" for t in REFUSED_EXAMPLES]
    return "\n".join(lines)
