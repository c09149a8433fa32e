"""Start and stop a swarm of local processes (a DHT peer and servers) on 127.0.0.1.

Used by `corolla demo`, the benchmarks and the test fixtures. Every process starts in its own process group
(its p2pd child included), and `close()` ends each group: SIGTERM, then SIGKILL after a grace period. A server is
ready when it prints its JSON ready record on stdout (`corolla serve`: `{"event": "ready", "peer_id": ...,
"maddrs": [...], "blocks": "A:B"}`, once per time it goes ONLINE); its peer id and blocks are read from that record.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Sequence

logger = logging.getLogger(__name__)

READY_EVENT = "ready"  # the "event" of the JSON line a server prints on stdout each time it goes ONLINE


@dataclass
class LocalProcess:
    name: str
    popen: subprocess.Popen[str]
    log: deque[str] = field(default_factory=lambda: deque(maxlen=400))
    ready: threading.Event = field(default_factory=threading.Event)  # set by the first ready record
    ready_records: list[dict] = field(default_factory=list)  # every ready record the server printed, in order

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def peer_id(self) -> str:
        """The server's peer id, from its ready record; RuntimeError before it is ready."""
        return str(self._last_ready()["peer_id"])

    @property
    def maddrs(self) -> list[str]:
        """The full multiaddrs clients dial the server at (each ending in /p2p/<peer id>), from its ready record."""
        return list(self._last_ready()["maddrs"])

    @property
    def blocks(self) -> str:
        """The blocks the server serves now, "A:B", from its latest ready record."""
        return str(self._last_ready()["blocks"])

    def served_ranges(self) -> list[str]:
        """Every "A:B" the server went ONLINE for, in order (more than one after a rebalancing move)."""
        return [str(record["blocks"]) for record in list(self.ready_records)]

    def _last_ready(self) -> dict:
        if not self.ready_records:
            raise RuntimeError(f"{self.name} is not ready yet")
        return self.ready_records[-1]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(list(self.log)[-lines:])

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class LocalSwarm:
    """A DHT bootstrap peer plus any number of servers, each a `corolla` subprocess."""

    def __init__(
        self, python: str = sys.executable, env: dict[str, str] | None = None, log_file: IO[str] | None = None
    ):
        self.python = python
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.log_file = log_file
        self.processes: list[LocalProcess] = []
        self.initial_peers: list[str] = []

    def start_dht(self, timeout: float = 60.0, args: Sequence[str] = ()) -> list[str]:
        """Start `corolla dht ARGS` and return its multiaddrs (read from its stdout)."""
        proc = self._spawn("dht", ["dht", "--host", "127.0.0.1", *args])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            maddrs = [line for line in list(proc.log) if line.startswith("/ip4/") and "/p2p/" in line]
            if maddrs:
                self.initial_peers = maddrs
                return maddrs
            if not proc.alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"DHT peer did not start:\n{proc.tail()}")

    def start_server(
        self,
        model: str,
        args: Sequence[str] = (),
        name: str | None = None,
        wait: bool = True,
        timeout: float = 180.0,
        verbose: bool = False,
    ) -> LocalProcess:
        """Start `corolla serve MODEL --initial-peers ... ARGS` (`corolla -v serve`, DEBUG logs, with `verbose`); with
        wait, block until it is ready (its JSON ready record)."""
        if not self.initial_peers:
            raise RuntimeError("start_dht() first")
        argv = ["serve", model, "--initial-peers", ",".join(self.initial_peers), *args]
        proc = self._spawn(name or f"server{len(self.processes)}", ["-v", *argv] if verbose else argv)
        if wait:
            self.wait_ready(proc, timeout)
        return proc

    def wait_ready(self, proc: LocalProcess, timeout: float = 180.0) -> None:
        """Block until the server's first ready record; RuntimeError after `timeout` seconds or if it exits first."""
        deadline = time.monotonic() + timeout
        while not proc.ready.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if not proc.alive() and not proc.ready.is_set():
                proc.ready.wait(1.0)  # its last lines may still be in the pipe
                if proc.ready.is_set():
                    return
                raise RuntimeError(
                    f"{proc.name} exited (code {proc.popen.returncode}) before it was ready:\n{proc.tail()}"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{proc.name} did not become ready in {timeout:.0f}s:\n{proc.tail()}")

    def kill(self, proc: LocalProcess, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the process's whole group (SIGKILL: an abrupt failure, p2pd included), except SIGTERM, which
        goes to the leader alone, as Ctrl+C would: it announces itself offline and shuts its own p2pd down (a p2pd
        signalled at the same time would die under it, leaving its goodbye to time out)."""
        if sig == signal.SIGTERM:
            proc.popen.send_signal(sig)
        else:
            proc.signal_group(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                proc.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            proc.signal_group(signal.SIGKILL)  # what is left of the group (none after a clean exit)
            proc.popen.wait(timeout=10)

    def close(self, grace: float = 10.0) -> None:
        """End every process this swarm started: SIGTERM to each leader (which shuts its own p2pd down, as on
        Ctrl+C), then SIGKILL to each whole process group after `grace` seconds."""
        for proc in reversed(self.processes):
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in reversed(self.processes):
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.signal_group(signal.SIGKILL)  # stragglers of the group (p2pd) even when the leader exited
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("process %s (pid %d) did not exit", proc.name, proc.pid)
        self.processes.clear()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: list[str]) -> LocalProcess:
        proc = LocalProcess(name, self._start_process(argv))
        self.processes.append(proc)
        threading.Thread(target=self._pump, args=(proc,), name=f"log-{name}", daemon=True).start()
        return proc

    def _start_process(self, argv: list[str]) -> subprocess.Popen[str]:
        """`corolla ARGV` in a new session (its own process group), stdout and stderr together as text."""
        return subprocess.Popen(
            [self.python, "-m", "corolla.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env,
            start_new_session=True,
        )

    def _pump(self, proc: LocalProcess) -> None:
        assert proc.popen.stdout is not None
        for line in proc.popen.stdout:
            line = line.rstrip("\n")
            proc.log.append(line)
            if self.log_file is not None:
                try:
                    self.log_file.write(f"[{proc.name}] {line}\n")
                    self.log_file.flush()
                except ValueError:  # log file closed
                    pass
            record = _ready_record(line)
            if record is not None:
                proc.ready_records.append(record)
                proc.ready.set()


def _ready_record(line: str) -> dict | None:
    """The ready record a line holds (a JSON object whose "event" is "ready"), else None."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("event") == READY_EVENT else None
