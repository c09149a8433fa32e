"""Shared fixtures: tiny random checkpoints written by the tests, and a real local swarm over them.

The swarm fixture starts a real DHT peer and two `corolla serve` processes on 127.0.0.1 (OS-assigned ports),
each in its own process group, and always ends those groups (p2pd included), even when a test fails.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from corolla.cli.local_swarm import LocalProcess, LocalSwarm

TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)
SERVER_ARGS = ["--num-threads", "1", "--announce-period", "5", "--max-session-length", "1024"]


def make_llama_checkpoint(directory: Path, seed: int = 0, **overrides: object) -> Path:
    """Write a tiny random-weight Llama checkpoint (safetensors + config) and return its directory."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


@dataclass
class Swarm:
    model_path: str
    initial_peers: list[str]
    local: LocalSwarm
    server_peer_ids: list[str]


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama"))


@pytest.fixture(scope="session")
def llama_swarm(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory):
    """A DHT peer and two servers splitting the tiny Llama's 4 blocks as 0:2 and 2:4."""
    log_path = tmp_path_factory.mktemp("logs") / "swarm.log"
    with open(log_path, "w") as log, LocalSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        peers = local.start_dht()
        servers = [
            local.start_server(tiny_llama_path, ["--blocks", "0:2", *SERVER_ARGS], name="server-a", wait=False),
            local.start_server(tiny_llama_path, ["--blocks", "2:4", *SERVER_ARGS], name="server-b", wait=False),
        ]
        for proc in servers:
            local.wait_ready(proc)
        peer_ids = [_peer_id_from_log(proc.tail(200)) for proc in servers]
        yield Swarm(tiny_llama_path, peers, local, peer_ids)


@dataclass
class NamedSwarm:
    """Servers started by name on one DHT: their processes and peer ids by those names."""

    model_path: str
    local: LocalSwarm
    peers: list[str]  # the DHT's multiaddrs
    procs: dict[str, LocalProcess]
    peer_ids: dict[str, str]


def start_named_servers(
    local: LocalSwarm, model_path: str, servers: dict[str, list[str]], ready_timeout: float = 180.0
) -> NamedSwarm:
    """`corolla serve MODEL ARGS... SERVER_ARGS` for each name -> args (all started at once), once each is ready.

    Starts the swarm's DHT peer first unless `local` already has one."""
    peers = local.initial_peers or local.start_dht()
    procs = {name: local.start_server(model_path, [*args, *SERVER_ARGS], name=name, wait=False)
             for name, args in servers.items()}
    for proc in procs.values():
        local.wait_ready(proc, ready_timeout)
    return NamedSwarm(model_path, local, peers, procs, {name: _peer_id_from_log(p.tail(200)) for name, p in procs.items()})


@pytest.fixture
def start_swarm(tiny_llama_path: str, tmp_path: Path) -> Iterator[Callable[..., NamedSwarm]]:
    """start_swarm(name=(blocks, extra args), ...) -> a DHT and those servers over the tiny Llama, all ended after
    the test."""
    with LocalSwarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}) as local:
        def start(**servers: tuple[str, list[str]]) -> NamedSwarm:
            return start_named_servers(
                local, tiny_llama_path, {name: ["--blocks", blocks, *extra] for name, (blocks, extra) in servers.items()}
            )

        yield start


def _peer_id_from_log(log: str) -> str:
    for line in log.splitlines():
        if "serving blocks" in line and " as " in line:
            return line.split(" as ")[1].split()[0]
    raise AssertionError(f"no peer id in server log:\n{log}")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return bool(value)
        time.sleep(interval)


class FakeHub:
    """Serves a local directory as a hub repo; like hf_hub_download, reuses a file already in the cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.downloads: list[str] = []

    def list_files(self, repo_id, *, revision, token, cache_dir):
        return {p.name: p.stat().st_size for p in sorted(self.root.iterdir())}

    def download(self, repo_id, filename, *, revision, token, cache_dir):
        target = Path(cache_dir) / "fake-hub" / repo_id.replace("/", "--") / (revision or "main") / filename
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.root / filename, target)
            self.downloads.append(filename)
        return target
