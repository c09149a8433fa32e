"""Peft LoRA adapters preloaded by a server (``corolla serve MODEL --adapters DIR_OR_REPO ...``).

An adapter is a peft ``save_pretrained`` folder (local, or a hub repo fetched through ``corolla.checkpoint``'s
cache): ``adapter_config.json`` plus ``adapter_model.safetensors`` (or ``adapter_model.bin``), whose tensors are

    base_model.model.{module}.lora_A.weight   (r, in_features)      module = the HF model's module path,
    base_model.model.{module}.lora_B.weight   (out_features, r)     e.g. model.layers.3.self_attn.q_proj

``{module}`` is mapped onto our blocks like a checkpoint name (the family's ``canonical_name`` and
``block_prefix``): block 3, layer ``self_attn.q_proj``. Every name is checked on every server (names only),
but a server reads the tensors of its own blocks only. An adapter is known by the string it was given
(repo id or path, as typed): servers announce these names and clients ask for them.

Requests pick their adapter per session / forward pass; ``AdapterCalls`` runs the compute functions with it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from corolla.checkpoint import CheckpointSource
from corolla.checkpoint.source import HubFiles
from corolla.checkpoint.reader import read_bin, read_safetensors
from corolla.models.lora import LoraWeights, attach_lora
from corolla.models.registry import ModelFamily
from corolla.server.compute.tensor_parallel import TensorParallelBlock
from corolla.server.compute.tensor_parallel_lora import attach_tensor_parallel_lora

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # in order of preference
_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIX = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")

# peft options that change what an adapter computes at inference and that we do not reproduce:
# option -> why it is refused. Each must be unset (None, False, empty) in the config.
_UNSUPPORTED_OPTIONS: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "modules_to_save": "modules_to_save (fully trained copies of whole modules)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. fused MoE experts)",
    "layer_replication": "layer_replication (repeated layers)",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "arrow_config": "Arrow routing between adapters",
    "megatron_config": "Megatron-parallel LoRA layers",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
# init_lora_weights values that leave the base weights untouched; the others (PiSSA, OLoRA, LoftQ, CorDA...)
# rewrite the base model at init, so the adapter only works with that rewritten model.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class LoraSettings:
    """The parts of a peft ``LoraConfig`` that decide a module's scale: ``alpha / r`` (``alpha / sqrt(r)`` with
    rsLoRA)."""

    r: int  # default rank
    lora_alpha: float  # default alpha
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)  # module-name pattern -> rank
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)  # module-name pattern -> alpha

    def rank_of(self, module: str) -> int:
        """The rank peft gave ``module`` (the HF model's module path, e.g. ``model.layers.0.mlp.up_proj``)."""
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r))

    def scale_of(self, module: str) -> float:
        """The factor peft multiplies ``module``'s update with."""
        rank = self.rank_of(module)
        alpha = float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha))
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """The first pattern that matches the end of ``module`` at a dot boundary (peft's rule), else ``module``."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return pattern
    return module


def parse_lora_config(raw: Mapping[str, Any], where: str) -> LoraSettings:
    """Validate a peft ``adapter_config.json`` (as a dict) for inference here; ``where`` names it in errors.

    Raises ``ValueError`` naming the option for other peft types and for LoRA options that change the
    computation in ways we do not reproduce (DoRA, fan_in_fan_out, lora_bias, modules_to_save, ...).
    Dropout is ignored: it does nothing at inference.
    """
    peft_type = str(raw.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r} is not supported; only LORA adapters are")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if raw.get(option):
            raise ValueError(f"{where}: {what} is not supported ({option}={raw[option]!r})")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases are not supported (bias={raw['bias']!r}); use bias='none'")
    init = raw.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise ValueError(
            f"{where}: init_lora_weights={init!r} rewrites the base weights, so the adapter needs that rewritten "
            "model; "
            "not supported (convert the adapter to plain LoRA with peft first)"
        )
    try:
        settings = LoraSettings(
            r=int(raw["r"]),
            lora_alpha=float(raw["lora_alpha"]),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: malformed LoRA config ({e!r})") from e
    if settings.r < 1 or any(rank < 1 for rank in settings.rank_pattern.values()):
        raise ValueError(f"{where}: ranks must be >= 1 (r={settings.r}, rank_pattern={dict(settings.rank_pattern)})")
    return settings


@dataclass(frozen=True)
class LoraTarget:
    """Where one adapted HF module lands: block ``block``, our layer ``layer`` (a path inside the block)."""

    module: str  # the HF model's module path, e.g. "model.layers.3.self_attn.q_proj"
    block: int
    layer: str  # e.g. "self_attn.q_proj"


def map_lora_names(names: Sequence[str], family: ModelFamily, num_blocks: int, where: str) -> dict[str, LoraTarget]:
    """Map every tensor name of a peft LoRA file onto our blocks: HF module path -> ``LoraTarget``.

    Pure (names only). Raises ``ValueError`` naming the first tensor that is not a plain LoRA ``lora_A``/``lora_B``
    weight (DoRA magnitudes, embedding LoRA, trained biases...), a module outside the transformer blocks
    (embeddings, LM head: the client holds those), or a module with only one of ``lora_A``/``lora_B``.
    """
    prefixes = {family.block_prefix(index): index for index in range(num_blocks)}
    halves: dict[str, set[str]] = {}
    targets: dict[str, LoraTarget] = {}
    for name in sorted(names):
        stripped = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
        match = _LORA_SUFFIX.match(stripped)
        module = match["module"] if match else re.split(r"\.(?:lora_\w+|base_layer|weight|bias)(?:\.|$)", stripped)[0]
        canonical = family.canonical_name(module + ".weight")[: -len(".weight")] + "."
        block = next((index for prefix, index in prefixes.items() if canonical.startswith(prefix)), None)
        if block is None:
            raise ValueError(
                f"{where}: adapts {module!r}, outside the {num_blocks} transformer blocks; servers hold only the "
                "blocks "
                "(LoRA on embeddings or the LM head is not supported)"
            )
        if match is None:
            what = "a DoRA magnitude" if "lora_magnitude_vector" in name else "not a lora_A/lora_B weight"
            raise ValueError(f"{where}: tensor {name!r} is not supported ({what}); only plain LoRA on linear layers is")
        halves.setdefault(module, set()).add(match["which"])
        targets[module] = LoraTarget(module, block, canonical[len(family.block_prefix(block)) : -1])
    incomplete = sorted(module for module, seen in halves.items() if seen != {"A", "B"})
    if incomplete:
        raise ValueError(f"{where}: modules {incomplete[:5]} lack lora_A or lora_B")
    if not targets:
        raise ValueError(f"{where}: holds no LoRA weights")
    return targets


def _weights_file(source: CheckpointSource) -> str:
    files = source.files()
    for filename in ADAPTER_WEIGHTS:
        if filename in files:
            return filename
    raise FileNotFoundError(f"no adapter weights in {source}: expected {' or '.join(ADAPTER_WEIGHTS)}")


def read_adapter_config(name: str, *, cache_dir: str | None = None, hub: HubFiles | None = None) -> LoraSettings:
    """Fetch and validate ``name``'s ``adapter_config.json`` (see ``parse_lora_config``); ``hub`` substitutes the
    hub client (tests).

    Raises ``FileNotFoundError`` when ``name`` is neither a directory nor a reachable hub repo or lacks the file,
    ``ValueError`` for an unsupported or malformed config.
    """
    source = CheckpointSource(name, cache_dir=cache_dir, hub=hub)
    path = source.fetch(ADAPTER_CONFIG)
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"adapter {name!r}: {ADAPTER_CONFIG} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"adapter {name!r}: {ADAPTER_CONFIG} is not a JSON object")
    return parse_lora_config(raw, f"adapter {name!r}")


def load_lora_adapter(
    name: str,
    family: ModelFamily,
    model_config: PretrainedConfig,
    blocks: range,
    *,
    cache_dir: str | None = None,
    max_disk_space: int | None = None,
    hub: HubFiles | None = None,
) -> dict[int, dict[str, LoraWeights]]:
    """The updates of adapter ``name`` (a directory or hub repo) for blocks ``blocks``: block -> layer -> weights.

    Only these blocks' tensors are read (float32, on CPU); blocks the adapter does not touch are absent. Every
    tensor name is validated, in all blocks. Raises ``FileNotFoundError`` / ``ValueError`` as
    ``read_adapter_config`` and ``map_lora_names`` do, and ``ValueError`` when a rank disagrees with the config.
    A hub repo's files go through the checkpoint disk cache (``cache_dir``, ``max_disk_space``); ``hub`` substitutes
    the hub client (tests).
    """
    where = f"adapter {name!r}"
    settings = read_adapter_config(name, cache_dir=cache_dir, hub=hub)
    source = CheckpointSource(name, cache_dir=cache_dir, max_disk_space=max_disk_space, hub=hub)
    filename = _weights_file(source)
    path = source.fetch(filename)
    if filename.endswith(".safetensors"):
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
    else:
        # memory-mapped: listing the names reads no tensor data
        names = [
            n
            for n, t in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()
            if isinstance(t, torch.Tensor)
        ]
    targets = map_lora_names(names, family, family.num_blocks(model_config), where)
    ours = {module for module, target in targets.items() if target.block in blocks}
    wanted = {f"{_PEFT_PREFIX}{m}.lora_{ab}.weight" for m in ours for ab in "AB"} & set(names)
    wanted |= {f"{m}.lora_{ab}.weight" for m in ours for ab in "AB"} & set(names)  # files saved without the prefix
    read = read_safetensors if filename.endswith(".safetensors") else read_bin
    tensors = read(path, wanted.__contains__, torch.float32) if wanted else {}
    updates: dict[int, dict[str, LoraWeights]] = {}
    for key, tensor in tensors.items():
        stripped = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
        match = _LORA_SUFFIX.match(stripped)
        assert match is not None  # map_lora_names accepted every name
        module = match["module"]
        if match["which"] == "B":
            continue
        target = targets[module]
        A = tensor  # (r, in_features)
        B = tensors[key[: -len("lora_A.weight")] + "lora_B.weight"]  # (out_features, r)
        if A.shape[0] != settings.rank_of(module):
            raise ValueError(f"{where}: {module} has rank {A.shape[0]}, but its config says {settings.rank_of(module)}")
        updates.setdefault(target.block, {})[target.layer] = LoraWeights(A, B, settings.scale_of(module))
    logger.info("adapter.loaded name=%s blocks=%s layers=%d", name, sorted(updates), sum(map(len, updates.values())))
    return updates


def attach_adapters(
    blocks: Sequence[nn.Module],
    start: int,
    names: Sequence[str],
    family: ModelFamily,
    model_config: PretrainedConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: str | None = None,
    max_disk_space: int | None = None,
) -> None:
    """Load each adapter of ``names`` and attach it to ``blocks`` (blocks ``start``, ``start + 1``, ...), in ``dtype``
    on ``device`` (a `TensorParallelBlock`: sliced per shard, on the shards' devices). Raises as ``load_lora_adapter``
    and ``attach_lora`` do, and ``ValueError`` for a name given twice."""
    if len(set(names)) != len(names):
        raise ValueError(f"--adapters names an adapter twice: {list(names)}")
    for name in names:
        updates = load_lora_adapter(
            name,
            family,
            model_config,
            range(start, start + len(blocks)),
            cache_dir=cache_dir,
            max_disk_space=max_disk_space,
        )
        for index, layers in sorted(updates.items()):
            block = blocks[index - start]
            if isinstance(block, TensorParallelBlock):  # each shard gets its slice, on its own device
                attach_tensor_parallel_lora(block, name, layers, dtype)
            else:
                attach_lora(block, name, layers, dtype, device)
