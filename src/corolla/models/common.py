"""What every model family shares: exact checkpoint loading, KV-cache validation and KV-cache writes.

The family specifics (names a checkpoint may carry and we skip, tied LM heads, alternative tensor
layouts) stay in the families; these functions only enforce the common contract.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import Tensor, nn


def check_exact_state(shapes: Mapping[str, tuple[int, ...]], state: Mapping[str, Tensor], what: str, *,
                      ignored: Collection[str] = (), note: str = "") -> None:
    """Raise ``ValueError`` unless ``state`` holds exactly the names of ``shapes``, each with that shape.

    Names in ``ignored`` may be present in ``state`` and are skipped. The key error reads
    ``"{what}: missing keys [...], unexpected keys [...]"`` (both sorted, ``note`` appended after a space
    when given); otherwise the first mismatch in ``shapes``' order reads
    ``"{what}: {name} has shape (...), expected (...)"``. Reads only; modifies nothing.
    """
    given = set(state) - set(ignored)
    missing, unexpected = sorted(set(shapes) - given), sorted(given - set(shapes))
    if missing or unexpected:
        suffix = f" {note}" if note else ""
        raise ValueError(f"{what}: missing keys {missing}, unexpected keys {unexpected}{suffix}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{what}: {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")


def load_exact_state(targets: Mapping[str, Tensor], state: Mapping[str, Tensor], what: str, *,
                     ignored: Collection[str] = ()) -> None:
    """Copy ``state[name]`` into ``targets[name]`` for every checkpoint name of ``targets``, in place.

    ``targets`` maps checkpoint names to the module's own tensors (e.g. ``module.state_dict()`` when the
    names are equal). Values are cast to each target's dtype and device. Raises ``ValueError`` as
    ``check_exact_state`` does, before copying anything: on error nothing is modified.
    """
    check_exact_state({name: tuple(t.shape) for name, t in targets.items()}, state, what, ignored=ignored)
    with torch.no_grad():
        for name, tensor in targets.items():
            tensor.copy_(state[name])


def load_head_state(head: nn.Module, state: Mapping[str, Tensor], names: Mapping[str, str], tied: bool) -> int:
    """Load a client head from checkpoint tensors under their full names; returns how many were loaded.

    ``names`` maps checkpoint name -> the head's parameter name. With ``tied`` embeddings the LM head is the
    embedding matrix, so ``lm_head.weight`` is neither required nor read (a checkpoint may still hold it, as HF
    allows). Errors as ``load_exact_state``; on error nothing is modified.
    """
    ignored = {"lm_head.weight"} if tied else set()
    own = head.state_dict()
    targets = {name: own[names[name]] for name in sorted(names) if name not in ignored}
    load_exact_state(targets, state, "client head", ignored=ignored)
    return len(targets)


def check_kv_cache(kv: tuple[Tensor, Tensor], x: Tensor, position: int, n_kv_heads: int, head_dim: int) -> None:
    """Raise ``ValueError`` unless ``kv = (k_cache, v_cache)`` fits hidden states ``x`` (B, T, H) at
    ``[position, position + T)``: each cache (B, n_kv_heads, S_max, head_dim) in ``x``'s dtype, with
    ``position + T <= S_max``. The error names the cache (``k_cache``/``v_cache``) and what is wrong."""
    B, T, _ = x.shape
    expected = (B, n_kv_heads, head_dim)
    for name, cache in zip(("k_cache", "v_cache"), kv, strict=True):
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != expected:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}, expected (B, n_kv_heads, S_max, head_dim) "
                             f"with (B, n_kv_heads, head_dim)={expected}")
        if cache.dtype != x.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from the hidden states' {x.dtype}")
        if position + T > cache.shape[2]:
            raise ValueError(f"positions [{position}, {position + T}) exceed the cache length {cache.shape[2]}")


def write_kv_cache(kv: tuple[Tensor, Tensor], k: Tensor, v: Tensor, position: int) -> tuple[Tensor, Tensor]:
    """Write this call's keys and values into the caller-owned caches at ``[position, position + T)``, in place,
    and return views of the cached keys and values ``[0, position + T)``.

    ``k``, ``v``: (B, n_kv_heads, T, head_dim); ``kv = (k_cache, v_cache)``, each (B, n_kv_heads, S_max, head_dim),
    already checked with ``check_kv_cache``. Returns two (B, n_kv_heads, position + T, head_dim) views.
    """
    k_cache, v_cache = kv
    T = k.shape[2]
    k_cache[:, :, position : position + T] = k  # (B, n_kv_heads, T, head_dim) into (B, n_kv_heads, S_max, head_dim)
    v_cache[:, :, position : position + T] = v
    return k_cache[:, :, : position + T], v_cache[:, :, : position + T]
