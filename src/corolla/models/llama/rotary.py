"""Rotary position embedding (RoPE) for the Llama family, with the rope-scaling variants HF configs use.

Supported ``rope_type`` values (transformers 5.x keeps them in ``config.rope_parameters``):

- ``default``: ``inv_freq[i] = theta ** (-2i / dim)``.
- ``linear``: default frequencies divided by ``factor`` (position interpolation).
- ``dynamic`` (dynamic NTK): while the sequence fits in ``max_position_embeddings`` this IS the default
  rope. Past it, HF enlarges the base from the current sequence length ``L = max position + 1``:
  ``theta * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2))``. HF does this statefully inside
  the model (the frequencies stick at the longest length seen until a call shorter than ``max_pos``
  resets them). We do it per call, from the call's own ``L = position + T``: identical to HF for a
  single full-sequence forward and for decoding with growing positions (HF recomputes every step then),
  and it never depends on what an earlier, unrelated session did. As in HF, keys already in a KV cache
  keep the rotation they were written with, so past ``max_pos`` incremental decoding and a full-sequence
  forward give different (both HF-exact) results.
- ``llama3``: Llama 3.1's piecewise frequency scaling by wavelength.
- ``yarn``: YaRN ramp between interpolated and extrapolated frequencies, with its cos/sin scaling
  (``attention_factor``, from ``mscale``/``mscale_all_dim`` when given).

The inverse frequencies are computed with the same float32 operations, in the same order, as
transformers 5.x, so cos/sin match HF bit for bit; that is why some expressions below keep HF's
slightly unusual dtype steps. ``longrope``, ``proportional`` and ``partial_rotary_factor != 1`` are not
Llama-family features and raise ``ValueError``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


def head_dim_of(config: PretrainedConfig) -> int:
    """The attention head size: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def rope_parameters_of(config: PretrainedConfig) -> dict[str, Any]:
    """A normalized copy of the config's rope parameters.

    Always has ``rope_type`` (one of ``SUPPORTED_ROPE_TYPES``) and ``rope_theta``; for ``llama3`` and
    ``yarn`` also ``original_max_position_embeddings`` (defaulting the way HF's ``standardize_rope_params``
    does). Reads ``config.rope_parameters`` (transformers 5.x) and falls back to the legacy
    ``rope_theta``/``rope_scaling`` attributes. Raises ``ValueError`` for unsupported types or for
    per-layer-type (nested) rope parameters, which no Llama-family model uses.
    """
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params: dict[str, Any] = dict(raw)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported by the llama family: {sorted(params)}")
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported by the llama family (needs 1.0)")
    if rope_type in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = getattr(
            config, "original_max_position_embeddings", config.max_position_embeddings
        )
    return params


def _default_inv_freq(base: float, dim: int) -> Tensor:
    """``1 / base ** (arange(0, dim, 2) / dim)`` in float32, shape (dim / 2,)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(params: dict[str, Any], dim: int) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend smoothly in between."""
    inv_freq = _default_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """YaRN: per-frequency ramp between interpolation (``/ factor``) and extrapolation, plus cos/sin scale."""
    base = params["rope_theta"]
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
        else:
            attention_factor = mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # the dimension index whose wavelength fits `num_rotations` times into the original context
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # (dim / 2,): 1 for high frequencies, 0 for low ones
    inv_freq = inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _dynamic_inv_freq(params: dict[str, Any], dim: int, max_position_embeddings: int, seq_len: int) -> Tensor:
    """Dynamic NTK for a sequence of ``seq_len`` tokens; equals the default rope while it fits."""
    factor = params["factor"]
    exponent = dim / (dim - 2)
    if seq_len <= max_position_embeddings:
        # HF's init path: python floats, and the stretch term is exactly 1, i.e. the default rope.
        stretch = (factor * max_position_embeddings / max_position_embeddings) - (factor - 1)
        base = params["rope_theta"] * stretch**exponent
    else:
        # HF's forward path gets seq_len as an int64 tensor, so this arithmetic runs in float32: mirror it.
        length = torch.maximum(torch.tensor(seq_len), torch.tensor(max_position_embeddings))
        base = params["rope_theta"] * ((factor * length / max_position_embeddings) - (factor - 1)) ** exponent
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def compute_inv_freq(config: PretrainedConfig, seq_len: int | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies and cos/sin scaling for this config.

    Returns ``(inv_freq, attention_scaling)``: ``inv_freq`` is float32 of shape (head_dim / 2,) on CPU;
    ``attention_scaling`` multiplies cos and sin (1.0 except for yarn). ``seq_len`` only matters for
    ``dynamic`` (the total sequence length of the call; ``None`` means within ``max_position_embeddings``).
    Raises ``ValueError`` for unsupported rope configurations.
    """
    params = rope_parameters_of(config)
    dim = head_dim_of(config)
    rope_type = params["rope_type"]
    max_pos = int(config.max_position_embeddings)
    if rope_type == "default":
        return _default_inv_freq(params["rope_theta"], dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        return _dynamic_inv_freq(params, dim, max_pos, seq_len if seq_len is not None else max_pos), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(params, dim), 1.0
    return _yarn_inv_freq(params, dim, max_pos)  # "yarn"; rope_parameters_of rejected everything else


def rotate_half(x: Tensor) -> Tensor:
    """(..., D) -> (..., D): ``[x1, x2] -> [-x2, x1]`` on the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape (B, n_heads, T, D) by ``cos``/``sin`` of shape (T, D), or (B, 1, T, D) when each row
    has its own positions; same dtype as ``x``."""
    if cos.dim() == 2:
        cos, sin = cos[None, None], sin[None, None]  # (1, 1, T, D), broadcast over batch and heads
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions, per the config's rope type.

    Holds no parameters or buffers: the float32 ``inv_freq`` is kept as a plain tensor and moved to the
    input's device on use, so ``block.to(torch.bfloat16)`` cannot round it (HF keeps it float32 too).
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_type: str = rope_parameters_of(config)["rope_type"]
        self.max_position_embeddings = int(config.max_position_embeddings)
        self._inv_freq, self.attention_scaling = compute_inv_freq(config)

    def _inv_freq_for(self, seq_len: int, device: torch.device) -> tuple[Tensor, float]:
        """(head_dim / 2,) float32 inverse frequencies for a call whose last position is ``seq_len - 1``."""
        if self.rope_type == "dynamic" and seq_len > self.max_position_embeddings:
            inv_freq, scaling = compute_inv_freq(self.config, seq_len=seq_len)
            return inv_freq.to(device), scaling
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq, self.attention_scaling

    def forward(self, position: int, length: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin for positions ``[position, position + length)``, each (length, head_dim) in ``dtype``.

        Computed in float32 and cast to ``dtype`` last, as HF does.
        """
        inv_freq, scaling = self._inv_freq_for(position + length, device)
        positions = torch.arange(position, position + length, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # (T, D / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        return cos.to(dtype), sin.to(dtype)
