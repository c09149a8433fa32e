"""Helpers for swarms on emulated hosts (corolla.netemu): start `corolla dht` / `corolla serve` in a host, drive a
client in another (client_agent.py), and the local HF model's greedy output to compare with."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.netemu import EmulatedNetwork, HostProcess, can_emulate

AGENT = str(Path(__file__).with_name("client_agent.py"))
READY_TIMEOUT = 300.0  # seconds a server may take to serve on a loaded machine
REQUEST_TIMEOUT = 240.0  # seconds one client command may take
# fixed throughput: no compute or bandwidth measurement at start (not under test here), deterministic routes
SERVER_ARGS = ["--num-threads", "1", "--max-session-length", "256", "--throughput", "100"]

_usable, _why_not = can_emulate()
needs_namespaces = pytest.mark.skipif(not _usable, reason=f"emulated hosts unavailable: {_why_not}")


def corolla(*args: str) -> list[str]:
    return [sys.executable, "-m", "corolla.cli.main", *args]


def start_dht(net: EmulatedNetwork, host: str, *args: str, label: str = "dht", log: IO[str] | None = None,
              timeout: float = 120.0) -> tuple[HostProcess, list[str]]:
    """`corolla dht ARGS` on `host`; returns the process and the multiaddrs it printed."""
    proc = net.spawn(host, corolla("dht", *args), label=label, log_file=log)
    proc.wait_for(r"^/ip4/.*/p2p/", timeout)
    proc.wait_for(r"DHT peer .* running", timeout)
    return proc, [line for line in proc.log if line.startswith("/ip4/") and "/p2p/" in line]


def start_server(net: EmulatedNetwork, host: str, model: str, peers: Sequence[str], *args: str, label: str,
                 log: IO[str] | None = None, wait: bool = True) -> HostProcess:
    proc = net.spawn(host, corolla("serve", model, "--initial-peers", *peers, *SERVER_ARGS, *args), label=label,
                     log_file=log)
    if wait:
        wait_serving(proc)
    return proc


def wait_serving(proc: HostProcess, timeout: float = READY_TIMEOUT) -> str:
    """Wait for a server's 'serving blocks' line; returns its peer id."""
    return proc.wait_for(r"serving blocks \d+:\d+ of .* as (\S+)", timeout).group(1)


class Agent:
    """tests/net/client_agent.py running on an emulated host: one corolla client, driven by JSON commands."""

    def __init__(self, net: EmulatedNetwork, host: str, model: str, peers: Sequence[str], *, swarm_key: str | None = None,
                 config: dict | None = None, label: str = "client", log: IO[str] | None = None):
        argv = [sys.executable, AGENT, model, "--initial-peers", *peers, "--config", json.dumps(config or {})]
        if swarm_key:
            argv += ["--swarm-key", swarm_key]
        self.proc = net.spawn(host, argv, label=label, log_file=log, stdin=True)
        self.ready = json.loads(self.proc.wait_for(r'^(\{"ready".*)$', REQUEST_TIMEOUT).group(1))

    def request(self, op: str, timeout: float = REQUEST_TIMEOUT, **fields: object) -> dict:
        start = self.proc.lines_printed
        self.proc.send(json.dumps({"op": op, **fields}))
        return json.loads(self.proc.wait_for(r'^(\{"ok".*)$', timeout, start=start).group(1))

    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
        reply = self.request("generate", ids=ids.tolist(), max_new_tokens=max_new_tokens)
        assert reply["ok"], f"generate failed: {reply.get('error')}\n{reply.get('trace', '')}\n{self.proc.tail()}"
        return reply["tokens"]


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
