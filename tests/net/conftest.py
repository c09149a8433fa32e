"""Swarms on emulated hosts: every peer in its own network namespace with its own 10.x address (corolla.netemu).

These tests need root (namespaces, TUN devices); elsewhere they skip, saying why. Each test makes its own
EmulatedNetwork; everything it starts (corolla processes, their p2pd, the switch, the namespaces) ends with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from netswarm import Reference, hf_greedy


@pytest.fixture(scope="module")
def reference(tiny_llama_path: str) -> Reference:
    return hf_greedy(tiny_llama_path)


@pytest.fixture
def net_log(tmp_path: Path):
    """One log file for every process of a test (each line prefixed with the process's name)."""
    with open(tmp_path / "processes.log", "w") as f:
        yield f
