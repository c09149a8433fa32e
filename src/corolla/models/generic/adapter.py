"""The one place corolla calls the installed transformers' decoder layers: called, never subclassed or patched
(subclassing is what pinned Petals to one transformers version). Everything that depends on how a transformers decoder
layer, its rotary embedding and its KV cache are
called lives here, so a transformers upgrade that changes it fails here, loudly, and in
tests/models/test_generic_adapter.py, which pins this calling convention.

The calling convention (transformers 5.x, checked from each layer class's signature, keywords only since some
families take ``position_embeddings`` second)::

    layer(hidden_states=x,                        (B, T, H)
          attention_mask=mask,                    (B|1, 1, T, L): bool for sdpa, additive float for eager, or None
          position_embeddings=(cos, sin),         each (B, T, head_dim), from the model's own rotary class
          cache=Cache(layers=[our layer] * ...),  or ``past_key_values=`` (older name); None without a cache
          position_ids=ids,                       (B, T), when the layer takes it
          use_cache=True/False)                   when the layer takes it
      -> (B, T, H)                                (a tuple's first element on layers that return one)

The layer's attention calls ``cache.update(keys, values, layer_idx, ...)`` with this step's keys and values
(B, n_kv_heads, T, head_dim) after rotary, and attends to what it returns: our ``BufferCacheLayer`` stores them
in the session's buffers and returns the keys and values the mask was built for (generic.kv). There is no
``cache_position`` in transformers 5.x; positions travel as ``position_ids`` and inside cos/sin. ``BufferCacheLayer``
implements transformers' cache-layer interface (``CacheLayerMixin``, which transformers documents for custom caches);
the decoder layers themselves are only called.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.initialization import no_init_weights

from corolla.models.generic.kv import KVAccess

CACHE_PARAMETERS = ("cache", "past_key_values")  # what transformers 5.x calls the layer's cache argument
REQUIRED_PARAMETERS = ("hidden_states", "attention_mask", "position_embeddings")
OPTIONAL_PARAMETERS = ("position_ids", "use_cache")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # the ones whose masks we build (bool / additive float)


class LayerCallError(ValueError):
    """A decoder layer class, rotary class or cache call does not follow the calling convention above."""


@dataclass(frozen=True)
class LayerSignature:
    """How one decoder layer class is called: the name of its cache argument and which optional ones it takes."""

    layer_class: type[nn.Module]
    cache_parameter: str  # "cache" or "past_key_values"
    takes_position_ids: bool
    takes_use_cache: bool

    @classmethod
    def of(cls, layer_class: type[nn.Module]) -> LayerSignature:
        """Read ``layer_class.forward``'s signature; raises ``LayerCallError`` naming what does not fit (a missing
        argument, or an extra required one such as per-layer inputs or another layer's states)."""
        parameters = dict(inspect.signature(layer_class.forward).parameters)
        parameters.pop("self", None)
        name = layer_class.__name__
        missing = [p for p in REQUIRED_PARAMETERS if p not in parameters]
        cache = [p for p in CACHE_PARAMETERS if p in parameters]
        if missing or not cache:
            absent = missing + ([] if cache else [" or ".join(CACHE_PARAMETERS)])
            raise LayerCallError(f"decoder layer {name}.forward takes no {', '.join(absent)}")
        known = {*REQUIRED_PARAMETERS, *OPTIONAL_PARAMETERS, *CACHE_PARAMETERS}
        extra = [
            p.name
            for p in parameters.values()
            if p.name not in known
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            and p.default is inspect.Parameter.empty
        ]
        if extra:
            raise LayerCallError(
                f"decoder layer {name}.forward requires inputs a transformer block does not have: {', '.join(extra)}"
            )
        return cls(layer_class, cache[0], "position_ids" in parameters, "use_cache" in parameters)


class BufferCacheLayer(CacheLayerMixin):
    """A transformers cache layer over corolla's buffers: ``update`` hands the keys and values to
    ``KVAccess.exchange`` (it stores them and returns what to attend to). One per block call."""

    is_sliding = False  # read by Cache helpers we do not use; the masks are ours

    def __init__(self, access: KVAccess) -> None:
        super().__init__()
        if access.exchange is None:
            raise ValueError("a cache-less call takes no cache layer")
        self.access = access
        self.exchange = access.exchange

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Store this step's keys/values (B, n_kv_heads, T, D); return (B, n_kv_heads, L, D) keys and values."""
        return self.exchange(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise LayerCallError("corolla builds the attention masks itself; a layer asked its cache for mask sizes")

    def get_seq_length(self) -> int:
        return int(self.access.key_positions.shape[1])

    def get_max_length(self) -> int:
        return -1


def make_cache(layer_idx: int, access: KVAccess | None) -> Cache | None:
    """The cache object a layer with index ``layer_idx`` is called with (None without a KV cache): a transformers
    ``Cache`` whose entry ``layer_idx`` (the index the layer passes to ``update``) is our ``BufferCacheLayer``."""
    if access is None or access.exchange is None:
        return None
    ours = BufferCacheLayer(access)
    return Cache(layers=[ours] * (layer_idx + 1))


def call_layer(
    layer: nn.Module,
    signature: LayerSignature,
    hidden: Tensor,
    *,
    attention_mask: Tensor | None,
    position_ids: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    cache: Cache | None,
) -> Tensor:
    """Run one HF decoder layer by the calling convention (module docstring): hidden (B, T, H) -> (B, T, H)."""
    kwargs: dict[str, Any] = {
        "hidden_states": hidden,
        "attention_mask": attention_mask,
        "position_embeddings": position_embeddings,
        signature.cache_parameter: cache,
    }
    if signature.takes_position_ids:
        kwargs["position_ids"] = position_ids
    if signature.takes_use_cache:
        kwargs["use_cache"] = cache is not None
    out = layer(**kwargs)
    if isinstance(out, tuple):  # layers of older style return (hidden_states, ...)
        out = out[0]
    if not isinstance(out, Tensor) or out.shape != hidden.shape:
        raise LayerCallError(
            f"{type(layer).__name__} returned {type(out).__name__} "
            f"{tuple(getattr(out, 'shape', ()))}, expected hidden states {tuple(hidden.shape)}"
        )
    return out


def build_layer(layer_class: type[nn.Module], config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """``layer_class(config, layer_idx)`` with its weights left uninitialized (they are loaded right after; buffers
    the constructor computes are kept). In the current default dtype and device (``torch.device("meta")`` works).
    transformers' ``no_init_weights`` swaps torch's init functions for no-ops while the layer is built, process-wide,
    as its own ``from_pretrained`` does; so no other thread should build modules meanwhile."""
    with no_init_weights():
        return layer_class(config, layer_idx)


class RotaryCall:
    """The model's own rotary embedding for one layer: ``(x, position_ids (B, T)) -> (cos, sin)``, each
    (B, T, head_dim) in x's dtype. Families with one rotary per layer type (Gemma 3: local and global bases) get
    the layer's type. Kept out of the block's module tree, so ``block.to(bfloat16)`` cannot round its float32
    inverse frequencies (transformers computes cos/sin in float32 too)."""

    def __init__(self, rotary_class: type[nn.Module], config: PretrainedConfig, layer_type: str | None) -> None:
        parameters = inspect.signature(rotary_class.forward).parameters
        if "position_ids" not in parameters:
            raise LayerCallError(f"rotary embedding {rotary_class.__name__}.forward takes no position_ids")
        self.layer_type = layer_type if "layer_type" in parameters else None
        if "layer_type" in parameters and layer_type is None:
            raise LayerCallError(f"{rotary_class.__name__} needs a layer type, and the config has no layer_types")
        default_dtype = torch.get_default_dtype()
        try:  # computed on the CPU in float32 whatever the defaults (a bfloat16 server sets them); moved on first use
            torch.set_default_dtype(torch.float32)
            with torch.device("cpu"):
                self.module = rotary_class(config)
        finally:
            torch.set_default_dtype(default_dtype)
        self.device = torch.device("cpu")

    def __call__(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        if x.device != self.device and x.device.type != "meta":
            self.module, self.device = self.module.to(x.device), x.device
        if self.layer_type is not None:
            return self.module(x, position_ids, layer_type=self.layer_type)
        return self.module(x, position_ids)


class _Probed(Exception):
    """Raised by the probing cache layer once the layer handed it its keys and values."""


class _ProbeLayer(CacheLayerMixin):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.shapes = (tuple(key_states.shape), tuple(value_states.shape))
        raise _Probed

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise _Probed

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


def probe_kv_shapes(
    layer: nn.Module, signature: LayerSignature, rotary: RotaryCall, layer_idx: int, hidden_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Call a layer built on the meta device with one token and a probing cache; returns the shapes of the keys and
    values it stores, each (1, n_kv_heads, 1, head_dim). Nothing is computed (meta tensors). Raises
    ``LayerCallError`` when the layer stores nothing through the cache (state of another kind, e.g. recurrent),
    or fails before it does."""
    x = torch.zeros(1, 1, hidden_size, device="meta")
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    probe = _ProbeLayer()
    try:
        with torch.device("meta"):
            cos_sin = rotary(x, ids)
        call_layer(
            layer,
            signature,
            x,
            attention_mask=None,
            position_ids=ids,
            position_embeddings=cos_sin,
            cache=Cache(layers=[probe] * (layer_idx + 1)),
        )
    except _Probed:
        assert probe.shapes is not None
        return probe.shapes
    except Exception as e:  # noqa: BLE001 (any failure of a foreign layer is reported as "does not fit")
        raise LayerCallError(
            f"{type(layer).__name__} failed on a probe call before storing keys and values: {type(e).__name__}: {e}"
        ) from e
    raise LayerCallError(
        f"{type(layer).__name__} stores no keys and values through the cache (its state is of "
        "another kind, e.g. recurrent or convolutional)"
    )


def attention_mask_for(implementation: str, allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The mask argument for the layer's attention implementation from a bool mask (True = may attend):
    sdpa takes it as is, eager an additive float mask (0 or the dtype's minimum, as transformers builds it)."""
    if allowed is None or implementation == "sdpa":
        return allowed
    if implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    raise LayerCallError(
        f"attention implementation {implementation!r} is not supported; use one of {ATTENTION_IMPLEMENTATIONS}"
    )
