"""Shared by the emulated-host tests: the skip condition, server flags, and the local HF model's greedy output."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.netemu import can_emulate

# fixed throughput: no compute or bandwidth measurement at start (not under test here), deterministic routes
SERVER_ARGS = ["--num-threads", "1", "--max-session-length", "256", "--throughput", "100"]

_usable, _why_not = can_emulate()
needs_namespaces = pytest.mark.skipif(not _usable, reason=f"emulated hosts unavailable: {_why_not}")


@dataclass
class Reference:
    """The local HF model's greedy continuation of a fixed prompt."""

    ids: torch.Tensor  # (1, T)
    tokens: list[list[int]]  # prompt + new tokens
    new_tokens: int


def hf_greedy(model_path: str, new_tokens: int = 6, seed: int = 5) -> Reference:
    torch.manual_seed(seed)
    ids = torch.randint(3, 120, (1, 7))
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return Reference(ids, out.tolist(), new_tokens)
