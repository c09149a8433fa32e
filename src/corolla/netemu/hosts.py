"""Emulated hosts on one machine: Linux network namespaces with their own 10.x addresses, joined by the switch.

    with EmulatedNetwork(["dht", "a", "b", "client"], rtt=0.05) as net:
        net.address("a")                       # "10.77.0.2"
        proc = net.spawn("a", [sys.executable, "-m", "corolla.cli.main", "serve", ...])
        net.run("client", ["ping", "-c", "1", net.address("a")])
        net.set_link("a", up=False)            # cable pulled; set_link("a", up=True) puts it back

Needs root (namespaces, TUN devices). `can_emulate()` says whether this machine allows it, and why not.

Isolation and cleanup: every namespace this run makes is named `corolla-<pid>-<random>-<host>`, so concurrent runs
never collide; each namespace routes only its own /24 through its TUN device (no default route), and the switch
drops packets for addresses it does not know, so nothing can reach a real interface. `close()` (also run by the
context manager and at interpreter exit) ends every process spawned in a namespace (its whole process group), then
the switch (its TUN devices vanish with it), then deletes the namespaces. Namespaces left by a run that was killed
outright (its pid gone) are removed by the next run.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import IO, Sequence

from corolla.netemu.process import HostProcess

logger = logging.getLogger(__name__)

NS_PREFIX = "corolla-"
_NS_PATTERN = re.compile(rf"^{NS_PREFIX}(\d+)-[0-9a-f]+-")
MTU = 65000
SWITCH_START_TIMEOUT = 20.0  # seconds
PROBE_PORT = 47999  # TCP port of the round-trip probe inside a host
COMMAND_TIMEOUT = 20.0  # seconds for one `ip` command or one switch control reply

_live: "weakref.WeakSet[EmulatedNetwork]" = weakref.WeakSet()


def can_emulate() -> tuple[bool, str]:
    """(True, "") when this process may create namespaces and TUN devices, else (False, why not)."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces and TUN devices need root"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return False, "/dev/net/tun does not exist"
    name = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=COMMAND_TIMEOUT)
    return True, ""


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    device: str  # the TUN device's name while it is created in the root namespace


class EmulatedNetwork:
    """Hosts `names`, every pair `rtt` seconds apart (round trip), each link capped at `rate_mbit` Mbit/s.

    `private` hosts accept no inbound TCP connections (as behind a NAT); `delays` sets per-host one-way link
    delays in seconds instead of rtt/4 each.
    """

    def __init__(self, names: Sequence[str], rtt: float = 0.0, rate_mbit: float | None = None,
                 private: Sequence[str] = (), delays: dict[str, float] | None = None,
                 subnet: str = "10.77.0.0/24", queue_limit: float = 0.5):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and non-empty, got {list(names)}")
        network = ipaddress.ip_network(subnet)
        if not network.is_private or network.num_addresses < len(names) + 2:
            raise ValueError(f"subnet {subnet} must be private and hold {len(names)} hosts")
        sweep_stale()
        run_id = secrets.token_hex(3)
        addresses = list(network.hosts())
        self.prefix_len = network.prefixlen
        self.hosts = {
            name: Host(name, f"{NS_PREFIX}{os.getpid()}-{run_id}-{name}", str(addresses[i]), f"ct{run_id}{i}")
            for i, name in enumerate(names)
        }
        self.processes: list[HostProcess] = []
        self._switch: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._closed = False
        delays = delays or {}
        rate = rate_mbit * 1e6 / 8 if rate_mbit else None
        config = {
            "queue_limit": queue_limit,
            "hosts": [
                {"name": h.name, "address": h.address, "device": h.device, "delay": delays.get(h.name, rtt / 4),
                 "rate": rate, "accept_inbound": h.name not in private}
                for h in self.hosts.values()
            ],
        }
        _live.add(self)
        try:
            self._start(config)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _start(self, config: dict) -> None:
        for host in self.hosts.values():
            _ip("netns", "add", host.namespace)
        self._switch = subprocess.Popen(
            [sys.executable, "-m", "corolla.netemu.switch", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        ready = self._reply(SWITCH_START_TIMEOUT)
        if "ready" not in ready:
            raise RuntimeError(f"the switch did not start: {ready}")
        for host in self.hosts.values():
            ns = host.namespace
            _ip("link", "set", host.device, "netns", ns)
            _ip("-n", ns, "link", "set", host.device, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{host.address}/{self.prefix_len}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "mtu", str(MTU), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        logger.info("emulated network up: %s", " ".join(f"{h.name}={h.address}" for h in self.hosts.values()))

    def _reply(self, timeout: float) -> dict:
        """The switch's next stdout line as JSON (bounded wait)."""
        assert self._switch is not None and self._switch.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self._switch.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            stderr = ""
            if self._switch.poll() is not None and self._switch.stderr is not None:
                stderr = self._switch.stderr.read()
            raise RuntimeError(f"no answer from the switch within {timeout:.0f}s {stderr}")
        return json.loads(box[0])

    # ------------------------------------------------------------------ use
    def address(self, name: str) -> str:
        return self.hosts[name].address

    def namespace(self, name: str) -> str:
        return self.hosts[name].namespace

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside host `name`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[name].namespace, *argv]

    def run(self, name: str, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `argv` to completion inside host `name` (bounded by `timeout` seconds)."""
        return subprocess.run(self.command(name, argv), capture_output=True, text=True, timeout=timeout)

    def spawn(self, name: str, argv: Sequence[str], label: str | None = None, env: dict[str, str] | None = None,
              log_file: IO[str] | None = None, stdin: bool = False) -> HostProcess:
        """Start `argv` inside host `name` in its own process group; its output is collected line by line.

        The process is ended by `close()` (or earlier by `HostProcess.stop()`)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the emulated network is closed")
            proc = HostProcess.start(label or name, self.command(name, argv), {**os.environ, **(env or {})}, log_file,
                                     stdin)
            self.processes.append(proc)
        return proc

    def measure_rtt(self, src: str, dst: str, samples: int = 10, port: int = PROBE_PORT) -> float:
        """Median TCP round trip from host src to host dst in seconds (corolla.netemu.probe on both ends)."""
        server = self.spawn(
            dst, [sys.executable, "-m", "corolla.netemu.probe", "serve", str(port)], label=f"probe-{dst}"
        )
        try:
            server.wait_for("listening", timeout=30.0)
            done = self.run(
                src, [sys.executable, "-m", "corolla.netemu.probe", "rtt", self.address(dst), str(port), str(samples)]
            )
            if done.returncode != 0:
                raise RuntimeError(f"rtt probe {src} -> {dst} failed: {done.stderr.strip()}")
            return json.loads(done.stdout.strip().splitlines()[-1])["median_ms"] / 1e3
        finally:
            server.stop(grace=2.0)
            with self._lock:
                if server in self.processes:
                    self.processes.remove(server)

    def set_link(self, name: str, **changes: object) -> None:
        """Change host `name`'s link: up (bool), delay (one-way seconds), rate (bytes/s or None), accept_inbound."""
        self._control({"op": "set_link", "host": name, **changes})

    def set_pair_delay(self, a: str, b: str, delay: float | None) -> None:
        """One-way delay between hosts a and b in seconds (None: back to the sum of their links' delays)."""
        self._control({"op": "set_pair_delay", "a": a, "b": b, "delay": delay})

    def stats(self) -> dict[str, dict[str, int]]:
        """Per host: packets it sent that were forwarded and dropped."""
        return self._control({"op": "stats"})["stats"]

    def _control(self, message: dict) -> dict:
        with self._lock:
            if self._switch is None or self._switch.poll() is not None:
                raise RuntimeError("the switch is not running")
            assert self._switch.stdin is not None
            self._switch.stdin.write(json.dumps(message) + "\n")
            self._switch.stdin.flush()
            reply = self._reply(COMMAND_TIMEOUT)
        if not reply.get("ok"):
            raise ValueError(f"switch refused {message}: {reply.get('error')}")
        return reply

    # ------------------------------------------------------------------ clean-up
    def close(self) -> None:
        """End every spawned process group, the switch, and delete the namespaces. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            processes, self.processes = self.processes, []
        for proc in processes:
            proc.stop()
        if self._switch is not None:
            _end_group(self._switch)
        for host in self.hosts.values():
            _remove_namespace(host.namespace)
        _live.discard(self)

    def __enter__(self) -> EmulatedNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _end_group(popen: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        if popen.poll() is not None:
            break
        try:
            os.killpg(popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            popen.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    for stream in (popen.stdin, popen.stdout, popen.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def _remove_namespace(namespace: str) -> None:
    """Kill whatever still runs inside `namespace` (by pid), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    done = subprocess.run(["ip", "netns", "del", namespace], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if done.returncode != 0 and "No such file" not in done.stderr:
        logger.warning("could not delete namespace %s: %s", namespace, done.stderr.strip())


def sweep_stale() -> list[str]:
    """Delete namespaces made by earlier runs whose process no longer exists; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    if removed:
        logger.info("removed namespaces of dead runs: %s", " ".join(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _close_all() -> None:
    for net in list(_live):
        net.close()
