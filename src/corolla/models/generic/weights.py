"""A generic block's checkpoint tensors in the layout its transformers layer holds in memory.

transformers 5.x keeps some weights differently from the checkpoints on the hub, and converts while loading: MoE
experts are fused (Qwen3-MoE's per-expert ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``
become ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I)), some modules renamed.
``save_pretrained`` converts back, so test checkpoints look like hub ones. The conversion rules are transformers'
own (``conversion_mapping.get_checkpoint_conversion_mapping(model_type)``); here they are applied to one block's
tensors: every rename, then per converter its operations, of which stacking (``MergeModulelist``) and
concatenating (``Concatenate``) are supported. A checkpoint needing another operation is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

from corolla.models.generic.architecture import GenericArchitecture

_SUPPORTED_OPERATIONS = (MergeModulelist, Concatenate)


def _natural_key(name: str) -> tuple[object, ...]:
    """Sort key that orders ``experts.10`` after ``experts.9``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def convert_block_tensors(arch: GenericArchitecture, index: int, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Block ``index``'s tensors ``state`` (names inside the layer, e.g. ``mlp.experts.0.gate_proj.weight``) in the
    layer's own layout (e.g. ``mlp.experts.gate_up_proj``). Names the rules do not touch pass through unchanged.
    Raises ``ValueError`` for a conversion operation we do not apply, or a converter that gets no tensors for
    one of its sources."""
    transforms = get_checkpoint_conversion_mapping(arch.model_type) or []
    if not transforms:
        return dict(state)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = arch.block_prefix(index)  # rules match full names: some patterns start with "."
    out: dict[str, Tensor] = {}
    groups: dict[tuple[int, str], dict[str, list[tuple[tuple[object, ...], Tensor]]]] = {}
    for name, tensor in state.items():
        full = prefix + name
        for renaming in renamings:
            full, _ = renaming.rename_source_key(full)
        for number, converter in enumerate(converters):
            target, pattern = converter.rename_source_key(full)
            if pattern is not None:
                groups.setdefault((number, target), {}).setdefault(pattern, []).append((_natural_key(full), tensor))
                break
        else:
            out[full[len(prefix):] if full.startswith(prefix) else full] = tensor
    for (number, target), sources in groups.items():
        converter = converters[number]
        for operation in converter.operations:
            if not isinstance(operation, _SUPPORTED_OPERATIONS):
                raise ValueError(f"block {index}: the checkpoint needs transformers' {type(operation).__name__} "
                                 f"conversion ({converter}), which corolla does not apply")
        missing = [p for p in converter.source_patterns if p not in sources]
        if missing:
            raise ValueError(f"block {index}: no tensors for {missing} of {converter}")
        values: dict[str, object] = {p: [t for _, t in sorted(found, key=lambda item: item[0])]
                                     for p, found in sources.items()}
        for operation in converter.operations:
            values = operation.convert(values, source_patterns=list(converter.source_patterns),
                                       target_patterns=list(converter.target_patterns))
        (tensor,) = values.values()
        out[target[len(prefix):] if target.startswith(prefix) else target] = tensor  # type: ignore[assignment]
    return out
