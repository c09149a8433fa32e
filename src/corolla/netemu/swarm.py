"""corolla processes on emulated hosts: `corolla dht` and `corolla serve` in a host, a client driven in another.

Used by tests/net and bench/bench_wan.py:

    dht, maddrs = start_dht(net, "dht", "--host", "0.0.0.0")
    server = start_server(net, "a", model, maddrs, "--blocks", "0:2", "--host", "0.0.0.0", label="server-a")
    client = Agent(net, "client", model, maddrs)          # corolla.netemu.client_agent in host "client"
    tokens = client.generate(ids, max_new_tokens=8)
"""

from __future__ import annotations

import json
import sys
from typing import IO, Sequence

from corolla.netemu.hosts import EmulatedNetwork
from corolla.netemu.process import HostProcess

READY_TIMEOUT = 300.0  # seconds a server may take to serve on a loaded machine
REQUEST_TIMEOUT = 240.0  # seconds one client command may take
SERVING = r"serving blocks \d+:\d+ of .* as (\S+)"


def corolla(*args: str) -> list[str]:
    """The command line of `corolla ARGS` with this interpreter."""
    return [sys.executable, "-m", "corolla.cli.main", *args]


def start_dht(net: EmulatedNetwork, host: str, *args: str, label: str = "dht", log: IO[str] | None = None,
              timeout: float = 120.0) -> tuple[HostProcess, list[str]]:
    """`corolla dht ARGS` on `host`; returns the process and the multiaddrs it printed."""
    proc = net.spawn(host, corolla("dht", *args), label=label, log_file=log)
    proc.wait_for(r"DHT peer .* running", timeout)
    return proc, [line for line in proc.log if line.startswith("/ip4/") and "/p2p/" in line]


def start_server(net: EmulatedNetwork, host: str, model: str, peers: Sequence[str], *args: str, label: str,
                 log: IO[str] | None = None, wait: bool = True) -> HostProcess:
    """`corolla serve MODEL --initial-peers PEERS ARGS` on `host`; with `wait`, once it serves."""
    proc = net.spawn(
        host, corolla("serve", model, "--initial-peers", ",".join(peers), *args), label=label, log_file=log
    )
    if wait:
        wait_serving(proc)
    return proc


def wait_serving(proc: HostProcess, timeout: float = READY_TIMEOUT) -> str:
    """Wait for a server's 'serving blocks' line; returns its peer id."""
    return proc.wait_for(SERVING, timeout).group(1)


def join_time(proc: HostProcess, timeout: float = READY_TIMEOUT) -> float:
    """Seconds from starting a server to its 'serving blocks' line (waits for the line)."""
    return proc.wait_for_line(SERVING, timeout)[1] - proc.started


class Agent:
    """corolla.netemu.client_agent running on an emulated host: one corolla client, driven by JSON commands."""

    def __init__(
        self,
        net: EmulatedNetwork,
        host: str,
        model: str,
        peers: Sequence[str],
        *,
        swarm_key: str | None = None,
        config: dict | None = None,
        label: str = "client",
        log: IO[str] | None = None,
    ):
        argv = [
            sys.executable,
            "-m",
            "corolla.netemu.client_agent",
            model,
            "--initial-peers",
            *peers,
            "--config",
            json.dumps(config or {}),
        ]
        if swarm_key:
            argv += ["--swarm-key", swarm_key]
        self.proc = net.spawn(host, argv, label=label, log_file=log, stdin=True)
        self.ready = json.loads(self.proc.wait_for(r'^(\{"ready".*)$', REQUEST_TIMEOUT).group(1))

    def request(self, op: str, timeout: float = REQUEST_TIMEOUT, **fields: object) -> dict:
        """Send one command and return the agent's JSON answer (see client_agent for the commands)."""
        start = self.proc.lines_printed
        self.proc.send(json.dumps({"op": op, **fields}))
        return json.loads(self.proc.wait_for(r'^(\{"ok".*)$', timeout, start=start).group(1))

    def generate(self, ids, max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens (prompt included) for `ids` (a (B, T) tensor or nested list); RuntimeError on failure."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        reply = self.request("generate", ids=ids, max_new_tokens=max_new_tokens)
        if not reply["ok"]:
            raise RuntimeError(f"generate failed: {reply.get('error')}\n{reply.get('trace', '')}\n{self.proc.tail()}")
        return reply["tokens"]
