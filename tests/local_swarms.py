"""Real local swarms for tests: TestSwarm (a LocalSwarm cheaper to start), NamedSwarm (its servers by name, and the
check that a test left them clean), start_named_servers, and the probe that asks servers for their live info.

Imported by conftest.py, which re-exports what the test modules use (`from conftest import TestSwarm, ...`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import server_zygote
from corolla.cli.local_swarm import LocalProcess, LocalSwarm

SERVER_ARGS = ["--num-threads", "1", "--announce-period", "5", "--max-session-length", "1024"]
CLEAN_TIMEOUT = 20.0  # seconds a shared swarm's servers get to free a finished test's caches (closing is async)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return bool(value)
        time.sleep(interval)


class TestSwarm(LocalSwarm):
    """A LocalSwarm for tests, cheaper to start: its DHT bootstrap peer runs in the test process (a real DHT node and
    p2pd on the client's event loop, not a `corolla dht` process whose imports, ~2 s of CPU, every swarm would pay
    before its servers may start; test_cli runs `corolla dht` itself), and its `corolla serve` processes are forked
    from a process that has imported the package once (server_zygote; ~3.5 s of CPU saved per server). Everything
    else is LocalSwarm's: each server in its own process group, all ended (then the bootstrap node) on close, even
    on failure."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._bootstrap = None

    def _start_process(self, argv: list[str]):
        """`corolla serve` forked from the session's zygote (server_zygote: the imports are paid once)."""
        return server_zygote.start_corolla(argv, self.env)

    def start_dht(self, timeout: float = 60.0) -> list[str]:
        from corolla.client.event_loop import run_sync
        from corolla.dht import create_swarm_node

        if self._bootstrap is None:
            self._bootstrap = run_sync(create_swarm_node(host="127.0.0.1"), timeout=timeout)
            self.initial_peers = run_sync(self._bootstrap.maddrs(), timeout=timeout)
        return self.initial_peers

    def close(self, grace: float = 0.0) -> None:
        """End every server at once (SIGKILL to its process group, p2pd included): a graceful shutdown takes seconds
        per server, and the tests of one (test_failover's clean shutdown, the demo's) make it themselves."""
        try:
            for proc in self.processes:
                proc.signal_group(signal.SIGKILL)
            super().close(grace)
        finally:
            node, self._bootstrap = self._bootstrap, None
            if node is not None:
                from corolla.client.event_loop import run_sync

                run_sync(node.shutdown(), timeout=30)


@dataclass
class NamedSwarm:
    """Servers started by name on one DHT: their processes and peer ids by those names."""

    model_path: str
    local: LocalSwarm
    peers: list[str]  # the DHT's multiaddrs
    procs: dict[str, LocalProcess]
    peer_ids: dict[str, str]

    @property
    def initial_peers(self) -> list[str]:
        return self.peers

    @property
    def server_peer_ids(self) -> list[str]:
        """The servers' peer ids in the order they were named."""
        return list(self.peer_ids.values())

    def problems(self) -> list[str]:
        """What is not as a test should leave it: a server that died, a cache not wholly free."""
        found = [f"{name} died:\n{proc.tail()}" for name, proc in self.procs.items() if not proc.alive()]
        for name, proc in self.procs.items():
            if proc.alive():
                info = PROBE.info(proc).info
                if info.cache_tokens_free != info.cache_tokens_total:
                    found.append(f"{name}: {info.cache_tokens_free} of {info.cache_tokens_total} cache tokens free")
        return found

    def assert_clean(self, timeout: float = CLEAN_TIMEOUT) -> None:
        """Every server alive with its whole cache free, within `timeout` seconds (a closed session's cache is
        freed asynchronously)."""
        assert wait_until(lambda: not self.problems(), timeout=timeout, interval=0.2), \
            "a session's cache was not released, or a server died: " + "; ".join(self.problems())


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
    return NamedSwarm(model_path, local, peers, procs, {name: proc.peer_id for name, proc in procs.items()})


class ServerProbe:
    """Asks servers of any swarm for their live info (rpc_info) over one P2P host of the test process's own (no
    DHT: it dials each server at the multiaddrs of its ready record). Started on first use, closed at session end."""

    def __init__(self) -> None:
        self._p2p = None

    def info(self, proc: LocalProcess, timeout: float = 10.0):
        """The server's InfoReply (sessions, free and total cache), straight from it."""
        from corolla.client.event_loop import run_sync
        from corolla.client.swarm.server_info import request_info
        from corolla.dht.node import dial

        async def ask():
            if self._p2p is None:
                from hivemind.p2p import P2P

                self._p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False,
                                             use_relay=False, use_ipfs=False)
            await dial(self._p2p, proc.peer_id, proc.maddrs, timeout)
            return await request_info(self._p2p, proc.peer_id, timeout)

        return run_sync(ask(), timeout=3 * timeout)

    def close(self) -> None:
        if self._p2p is not None:
            from corolla.client.event_loop import run_sync

            p2p, self._p2p = self._p2p, None
            run_sync(p2p.shutdown(), timeout=30)


PROBE = ServerProbe()
