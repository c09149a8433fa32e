"""Shared by the emulated-host tests: the skip condition, server flags, the local HF model's greedy output, and
their fixtures (imported by the test modules: a conftest.py here would shadow tests/conftest.py for the modules
that `import conftest`).

Swarms on emulated hosts: every peer in its own network namespace with its own 10.x address (corolla.netemu).
These tests need root (namespaces, TUN devices); elsewhere they skip, saying why. Each test makes its own
EmulatedNetwork; everything it starts (corolla processes, their p2pd, the switch, the namespaces) ends with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.netemu import can_emulate

# fixed throughput: no compute or bandwidth measurement at start (not under test here), deterministic routes
SERVER_ARGS = ["--num-threads", "1", "--max-session-length", "256", "--throughput", "100"]

def wait_until(predicate, timeout: float, interval: float = 0.5):
    """Poll until `predicate()` returns something truthy (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


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


@pytest.fixture(scope="module")
def reference(tiny_llama_path: str) -> Reference:
    return hf_greedy(tiny_llama_path)


@pytest.fixture
def net_log(tmp_path: Path):
    """One log file for every process of a test (each line prefixed with the process's name)."""
    with open(tmp_path / "processes.log", "w") as f:
        yield f
