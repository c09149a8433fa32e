"""Helpers of the monitor tests: a `corolla monitor` process, free ports, HTTP GETs and Prometheus parsing."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

from server_zygote import start_corolla

URL_LINE = re.compile(r"INFO .*(http://[0-9.]+:\d+)")
SIX_BLOCKS = dict(num_hidden_layers=6)  # the tiny Llama with 6 blocks: three servers of two blocks each


@dataclass
class MonitorProcess:
    popen: subprocess.Popen[str]
    url: str = ""
    log: deque[str] = field(default_factory=lambda: deque(maxlen=400))

    def tail(self, lines: int = 40) -> str:
        return "\n".join(list(self.log)[-lines:])


@contextmanager
def running_monitor(initial_peers: list[str], *args: str, timeout: float = 120.0) -> Iterator[MonitorProcess]:
    """`corolla monitor --initial-peers ... --port 0 ARGS` in its own process group, once it logged its URL; ended
    with SIGTERM (the group SIGKILLed after a grace period) however the test ends."""
    popen = start_corolla(["monitor", "--initial-peers", *initial_peers, "--port", "0", *args],
                          {**os.environ, "PYTHONUNBUFFERED": "1"})
    proc = MonitorProcess(popen)
    found = threading.Event()

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            proc.log.append(line.rstrip("\n"))
            match = URL_LINE.search(line)
            if match and not proc.url:
                proc.url = match.group(1)
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not found.wait(timeout):
            raise AssertionError(f"corolla monitor logged no URL within {timeout:.0f}s:\n{proc.tail()}")
        yield proc
    finally:
        stop_group(popen)


def stop_group(popen: subprocess.Popen[str], grace: float = 15.0) -> int | None:
    """SIGTERM the leader, then SIGKILL its whole process group (p2pd included); returns the leader's exit code."""
    code = None
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
    try:
        code = popen.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    popen.wait(timeout=10)
    return code


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 30.0) -> tuple[int, str, str]:
    """(status, content type, body) of a GET."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read().decode()


def get_json(url: str) -> dict:
    return json.loads(http_get(url)[2])


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text endpoint, parsed by prometheus_client: (name, sorted labels) -> value."""
    text = http_get(url)[2]
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample's value, 0.0 when the series does not exist (yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, timeout: float, interval: float = 0.25, describe=None):
    """Poll until `predicate()` is truthy; returns its value, or raises AssertionError after `timeout` seconds
    (with `describe()`, what was seen instead)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            seen = f"; seen: {describe()}" if describe is not None else ""
            raise AssertionError(f"condition not met within {timeout:.0f}s{seen}")
        time.sleep(interval)
