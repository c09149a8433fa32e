"""What the generic backend reads from an HF config and the installed transformers, or why it cannot serve it.

``inspect_architecture(config)`` builds the model on the meta device (no memory, no weights) and reads off:
the decoder layer class and how it is called (generic.adapter), the rotary class, where the layers and the client
head's modules sit, the checkpoint names of the head, each layer's KV layout (probed: a meta call of each layer
records the keys and values it stores) and attention window, and what the head does outside the modules (from
config attributes). A config that does not fit gets ``UnsupportedArchitecture`` naming every reason found:
encoder-decoders, hybrids whose layers keep non-K/V state, multi-head latent attention (keys and values of
different widths; DeepSeek-V3 would cache a compressed latent), layers that need more than hidden states,
parameters outside the layers that the client head does not model, and so on.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from corolla.models.generic.adapter import (
    ATTENTION_IMPLEMENTATIONS,
    LayerCallError,
    LayerSignature,
    RotaryCall,
    probe_kv_shapes,
)

logger = logging.getLogger(__name__)

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # config.layer_types values with a K/V cache
# Config attributes meaning work outside the decoder layers that the client head does not do: attribute -> what.
_UNMODELED_ATTRIBUTES: dict[str, str] = {
    "scale_emb": "embedding scale scale_emb (MiniCPM)",
    "dim_model_base": "logit scaling by dim_model_base (MiniCPM)",
    "embedding_multiplier_scale": "embedding_multiplier_scale (Grok)",
    "output_multiplier_scale": "output_multiplier_scale (Grok)",
    "altup_num_inputs": "AltUp per-layer inputs (Gemma 3n)",
    "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 3n)",
    "num_kv_shared_layers": "KV caches shared between layers",
    "attention_chunk_size": "chunked local attention (Llama 4)",
    "kv_lora_rank": "multi-head latent attention (MLA): it caches a compressed latent, not per-head keys and values",
}


class UnsupportedArchitecture(ValueError):
    """The config cannot run on the generic backend; ``reasons`` (and the message) name every reason found."""

    def __init__(self, model_type: str, reasons: list[str]) -> None:
        super().__init__(f"model_type {model_type!r} cannot run on the generic backend: {'; '.join(reasons)}")
        self.model_type = model_type
        self.reasons = tuple(reasons)


@dataclass(frozen=True)
class HeadSpec:
    """The client head: HF modules (attribute paths in the causal-LM model) and what it does around them."""

    embed: str  # e.g. "model.embed_tokens" (its class may scale, e.g. Gemma's sqrt(hidden_size))
    norm: str  # e.g. "model.norm"
    lm_head: str  # e.g. "lm_head"
    tensors: frozenset[str]  # checkpoint names the client loads (lm_head.* included even when tied)
    tied: bool  # lm_head shares the embedding matrix
    embedding_multiplier: float | None  # multiplies the embeddings (Granite: config.embedding_multiplier)
    logit_divisor: float | None  # divides the logits (Granite: config.logits_scaling)
    logit_multiplier: float | None  # multiplies the logits (Cohere: config.logit_scale)
    final_softcap: float | None  # logits = cap * tanh(logits / cap) (Gemma 2/3: config.final_logit_softcapping)


@dataclass(frozen=True)
class GenericArchitecture:
    """Everything the generic block and head need; built by ``inspect_architecture``."""

    model_type: str
    config: PretrainedConfig  # a private copy, its attention implementation set to one we build masks for
    layer_class: type[nn.Module]
    signature: LayerSignature
    rotary_class: type[nn.Module]
    layers_path: str  # attribute path of the decoder layers in the causal-LM model, e.g. "model.layers"
    num_layers: int
    n_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: attention window in tokens, None for full attention
    layer_types: tuple[str | None, ...]  # per layer: config.layer_types entry (selects a rotary), or None
    attn_implementation: str  # "sdpa" or "eager"
    head: HeadSpec

    def block_prefix(self, index: int) -> str:
        """Checkpoint-name prefix of layer ``index``, e.g. ``"model.layers.3."``."""
        return f"{self.layers_path}.{index}."


_CACHE: dict[str, GenericArchitecture] = {}
_CACHE_LOCK = threading.Lock()


def inspect_architecture(config: PretrainedConfig) -> GenericArchitecture:
    """The ``GenericArchitecture`` of ``config`` (cached per config contents and attention implementation: an
    unset one resolves as transformers does, sdpa where the model supports it). Raises ``UnsupportedArchitecture``."""
    key = f"{config._attn_implementation}:{config.to_json_string(use_diff=False)}"
    with _CACHE_LOCK:
        found = _CACHE.get(key)
    if found is None:
        found = _inspect(config)
        sliding = sorted({w for w in found.windows if w})
        logger.info("generic backend: model_type=%s layer=%s attention=%s kv=(%d heads, %d dims) windows=%s",
                    found.model_type, found.layer_class.__name__, found.attn_implementation, found.n_kv_heads,
                    found.head_dim, sliding or "none")
        with _CACHE_LOCK:
            _CACHE[key] = found
    return found


def _config_problems(config: PretrainedConfig) -> list[str]:
    problems = []
    if getattr(config, "is_encoder_decoder", False):
        problems.append("an encoder-decoder model (only decoder-only models run as a chain of blocks)")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention (use_bidirectional_attention=True)")
    for attribute, what in _UNMODELED_ATTRIBUTES.items():
        if getattr(config, attribute, None) not in (None, 0, False):
            problems.append(what)
    layer_types = getattr(config, "layer_types", None)
    other = sorted({t for t in layer_types or () if t not in ATTENTION_LAYER_TYPES})
    if other:
        problems.append(f"layers that keep non-K/V state (layer types {', '.join(other)}: a hybrid)")
    return problems


def _meta_model(config: PretrainedConfig) -> nn.Module:
    """The causal-LM model of ``config`` on the meta device; raises UnsupportedArchitecture if transformers has none."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError, RuntimeError, AssertionError) as e:
        raise UnsupportedArchitecture(
            str(config.model_type), [f"transformers builds no causal LM from this config ({type(e).__name__}: {e})"]
        ) from e


def _module_path(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, module in model.named_modules() if module is target), None)


def _inspect(config: PretrainedConfig) -> GenericArchitecture:
    model_type = str(getattr(config, "model_type", "") or "")
    problems = _config_problems(config)
    if problems:
        raise UnsupportedArchitecture(model_type, problems)
    model = _meta_model(config)
    resolved = model.config
    base = getattr(model, "model", None) or model.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise UnsupportedArchitecture(model_type, ["its model keeps no `layers` list of decoder layers"])
    layers_path = _module_path(model, layers)
    classes = sorted({type(layer).__name__ for layer in layers})
    if len(classes) > 1:
        problems.append(f"layers of several kinds ({', '.join(classes)}: a hybrid)")
    rotary = getattr(base, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        problems.append("no rotary embedding `rotary_emb` (positions of another kind: ALiBi, learned, none)")
    signature = None
    try:
        signature = LayerSignature.of(type(layers[0]))
    except LayerCallError as e:
        problems.append(str(e))
    head, head_problems = _head_spec(model, base, layers_path, resolved)
    problems += head_problems
    private = copy.deepcopy(resolved)
    implementation = str(private._attn_implementation or "eager")
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        implementation = "sdpa" if getattr(type(model), "_supports_sdpa", False) else "eager"
        private._attn_implementation = implementation
    layer_types = tuple(getattr(private, "layer_types", None) or (None,) * len(layers))
    layout = None
    if signature is not None and rotary is not None:
        layout, probe_problems = _probe_layouts(layers, signature, type(rotary), private, layer_types)
        problems += probe_problems
    if problems:
        raise UnsupportedArchitecture(model_type, problems)
    assert signature is not None and rotary is not None and head is not None and layers_path is not None
    assert layout is not None
    windows = tuple(_window_of(private, layer, layer_types[i]) for i, layer in enumerate(layers))
    return GenericArchitecture(
        model_type=model_type, config=private, layer_class=type(layers[0]), signature=signature,
        rotary_class=type(rotary), layers_path=layers_path, num_layers=len(layers), n_kv_heads=layout[0],
        head_dim=layout[1], windows=windows, layer_types=layer_types, attn_implementation=implementation, head=head,
    )


def _window_of(config: PretrainedConfig, layer: nn.Module, layer_type: str | None) -> int | None:
    """A layer's attention window, as transformers' masks apply it: ``config.sliding_window`` on layers whose
    ``layer_types`` entry is sliding (none on the others); without layer types, on every layer whose attention
    module does not say otherwise (``is_sliding`` / ``sliding_window``), as Mistral, Phi-3 and Qwen3-MoE do."""
    window = getattr(config, "sliding_window", None)
    attention = getattr(layer, "self_attn", None)
    if layer_type is not None:
        window = window if layer_type == "sliding_attention" else None
    elif attention is not None and hasattr(attention, "is_sliding"):
        window = window if attention.is_sliding else None
    elif attention is not None and hasattr(attention, "sliding_window"):
        window = attention.sliding_window
    return int(window) if window else None


def _probe_layouts(
    layers: nn.ModuleList, signature: LayerSignature, rotary_class: type[nn.Module], config: PretrainedConfig,
    layer_types: tuple[str | None, ...],
) -> tuple[tuple[int, int] | None, list[str]]:
    """(n_kv_heads, head_dim) shared by every layer, from what each layer stores in its cache (meta calls), or the
    reasons there is none."""
    rotaries: dict[str | None, RotaryCall] = {}
    layouts: dict[tuple[int, int], list[int]] = {}
    for index, layer in enumerate(layers):
        layer_type = layer_types[index]
        try:
            if layer_type not in rotaries:
                rotaries[layer_type] = RotaryCall(rotary_class, config, layer_type)
            keys, values = probe_kv_shapes(layer, signature, rotaries[layer_type], index, int(config.hidden_size))
        except LayerCallError as e:
            return None, [f"layer {index}: {e}"]
        if keys[1] != values[1] or keys[3] != values[3]:
            return None, [f"layer {index} stores keys {keys} and values {values} of different shapes; corolla's "
                          "cache holds keys and values of one (n_kv_heads, head_dim)"]
        layouts.setdefault((keys[1], keys[3]), []).append(index)
    if len(layouts) > 1:
        described = "; ".join(f"layers {v[:4]}: (n_kv_heads, head_dim)={k}" for k, v in layouts.items())
        return None, [f"KV layouts differ between layers ({described})"]
    return next(iter(layouts)), []


def _head_spec(model: nn.Module, base: nn.Module, layers_path: str | None,
               config: PretrainedConfig) -> tuple[HeadSpec | None, list[str]]:
    """The client head's modules and settings, or the reasons the head does not fit."""
    problems = []
    embed = _module_path(model, model.get_input_embeddings())
    lm_head = _module_path(model, model.get_output_embeddings())
    norm = _module_path(model, getattr(base, "norm", None))
    for what, path in (("input embeddings", embed), ("LM head", lm_head), ("final norm `norm`", norm)):
        if path is None:
            problems.append(f"no {what} found")
    if problems:
        return None, problems
    head_prefixes = tuple(f"{p}." for p in (embed, norm, lm_head))
    outside = sorted(name for name in model.state_dict()
                     if not name.startswith(f"{layers_path}.") and not name.startswith(head_prefixes))
    if outside:
        problems.append(f"parameters outside the decoder layers that the client head does not run: {outside[:6]}")
    tensors = frozenset(name for name in model.state_dict() if name.startswith(head_prefixes))
    tensors |= {f"{lm_head}.weight"}  # a tied checkpoint may still hold it
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    spec = HeadSpec(
        embed=embed, norm=norm, lm_head=lm_head, tensors=tensors, tied=tied,
        embedding_multiplier=_float_or_none(getattr(config, "embedding_multiplier", None)),
        logit_divisor=_float_or_none(getattr(config, "logits_scaling", None)),
        logit_multiplier=_float_or_none(getattr(config, "logit_scale", None)),
        final_softcap=_float_or_none(getattr(config, "final_logit_softcapping", None)),
    )
    return spec, problems


def _float_or_none(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
