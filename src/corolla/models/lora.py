"""LoRA adapters on a block's linear layers: several named adapters per layer, one active per call.

A LoRA adapter adds a low-rank update to a linear layer ``y = base(x)``:

    y = base(x) + (x @ A^T) @ B^T * scale        A: (r, in_features), B: (out_features, r)

(``scale`` is peft's ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; computed by whoever loads
the adapter). ``LoraLinear`` wraps one linear layer and holds any number of named (A, B, scale); which one
applies is read from a context variable that ``using_adapter(name)`` sets around a forward pass (``None``:
the base layer alone). So requests with different adapters, and without one, share the same loaded blocks:
the server sets the request's adapter around each step it computes. A context variable rather than an
argument, because the blocks' forward signatures are shared by every family and must not change.

Only linear layers whose weight our block stores exactly as the HF checkpoint does can take an adapter
(fused layouts that we re-pack would need the update re-packed too); ``attach_lora`` refuses anything else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

_ACTIVE: ContextVar[str | None] = ContextVar("corolla_active_adapter", default=None)


@contextlib.contextmanager
def using_adapter(name: str | None) -> Iterator[None]:
    """Within the block, every ``LoraLinear`` forward in this context (thread/task) applies adapter ``name``;
    ``None`` runs the base layers alone. Restores the previous adapter on exit."""
    token = _ACTIVE.set(name)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_adapter() -> str | None:
    """The adapter ``using_adapter`` made active in this context, or None."""
    return _ACTIVE.get()


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's update of one linear layer: ``(x @ A^T) @ B^T * scale``."""

    A: Tensor  # (r, in_features)
    B: Tensor  # (out_features, r)
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])


class LoraLinear(nn.Module):
    """A linear layer plus named LoRA adapters; the active one (``using_adapter``) is added to its output.

    Adapters are stored on the device and in the dtype given to ``add``; ``.to()`` does not move them, so
    attach adapters after the block is on its device. Without an active adapter, or when the active adapter
    does not touch this layer, the output is exactly ``base(x)``.
    """

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.adapters: dict[str, LoraWeights] = {}

    def add(self, name: str, weights: LoraWeights, dtype: torch.dtype, device: torch.device) -> None:
        """Hold adapter ``name``'s weights (cast to ``dtype`` on ``device``); raises ``ValueError`` when their
        shapes do not fit this layer or ``name`` is already held."""
        check_lora_shapes(weights, self.in_features, self.out_features, name)
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already attached to this layer")
        self.adapters[name] = LoraWeights(
            weights.A.to(device=device, dtype=dtype).contiguous(),
            weights.B.to(device=device, dtype=dtype).contiguous(),
            float(weights.scale),
        )

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features)."""
        out = self.base(x)
        name = _ACTIVE.get()
        lora = self.adapters.get(name) if name is not None else None
        if lora is None:
            return out
        # peft's order: lora_B(lora_A(x)) * scaling, in the adapter's dtype, added to the base output
        low = F.linear(x.to(lora.A.dtype), lora.A)  # (..., r)
        return out + (F.linear(low, lora.B) * lora.scale).to(out.dtype)  # (..., out_features)


def check_lora_shapes(weights: LoraWeights, in_features: int, out_features: int, what: str) -> None:
    """Raise ``ValueError`` unless A is (r, in_features) and B is (out_features, r) with r >= 1."""
    A, B = weights.A, weights.B
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] < 1 or A.shape[0] != B.shape[1]:
        raise ValueError(f"{what}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not (r, in) and (out, r)")
    if A.shape[1] != in_features or B.shape[0] != out_features:
        raise ValueError(
            f"{what}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit a linear layer with "
            f"in_features={in_features}, out_features={out_features}"
        )


def linear_layers(block: nn.Module) -> list[str]:
    """Paths of the block's linear layers that can take an adapter (``"self_attn.q_proj"``, ...), sorted."""
    wrapped = {f"{name}.base" for name, module in block.named_modules() if isinstance(module, LoraLinear)}
    return sorted(
        name for name, module in block.named_modules()
        if isinstance(module, LoraLinear) or (isinstance(module, nn.Linear) and name not in wrapped)
    )


def attach_lora(block: nn.Module, name: str, updates: Mapping[str, LoraWeights],
                dtype: torch.dtype, device: torch.device) -> None:
    """Attach adapter ``name`` to the block's linear layers ``updates`` names (paths inside the block, e.g.
    ``"mlp.down_proj"``), wrapping each plain ``nn.Linear`` in a ``LoraLinear`` the first time.

    Raises ``ValueError`` naming the layer when a path is not a linear layer of this block or the shapes do not
    fit; everything is checked before the block is changed, so on error nothing is modified.
    """
    resolved: dict[str, nn.Module] = {}
    for path in sorted(updates):
        try:
            module = block.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, (nn.Linear, LoraLinear)):
            found = "no such module" if module is None else f"a {type(module).__name__}, not a linear layer"
            raise ValueError(
                f"adapter {name!r} targets {path!r}: {found} in our {type(block).__name__}; "
                f"layers that can take an adapter: {linear_layers(block)}"
            )
        check_lora_shapes(updates[path], int(module.in_features), int(module.out_features),
                          f"adapter {name!r} at {path}")
        if isinstance(module, LoraLinear) and name in module.adapters:
            raise ValueError(f"adapter {name!r} is already attached to {path}")
        resolved[path] = module
    for path, module in resolved.items():
        if not isinstance(module, LoraLinear):
            parent_path, _, attr = path.rpartition(".")
            parent = block.get_submodule(parent_path) if parent_path else block
            module = LoraLinear(module)
            setattr(parent, attr, module)
        module.add(name, updates[path], dtype, device)
    logger.debug("lora.attached adapter=%s layers=%d", name, len(resolved))
