"""Start `corolla` processes (serve, api, monitor) by forking one that has imported the package already (a "zygote").

A fresh `python -m corolla.cli.main serve ...` spends about 3.5 s of CPU importing torch, transformers, hivemind and
corolla before it does anything of its own; the suite starts about a hundred servers. The zygote is one process,
started once (fork + exec, as any subprocess), that imports all of that and then waits. Asked for a server, it forks:
the child starts a new session (its own process group, as LocalSwarm's processes have: killpg ends it and its p2pd),
takes the pipe it was handed as stdout and stderr, the caller's environment and working directory, reseeds the
random number generators it shares with its siblings, and runs `corolla.cli.main.main(argv)`: the real command in a
real process of its own, minus the imports. The zygote never runs a thread, an event loop or a torch op before it
forks (those do not survive a fork); it reaps its children and reports their exit codes.

`start_corolla(argv, env)` returns a `ForkedProcess`, which offers what LocalSwarm and the tests use of a
`subprocess.Popen` (pid, args, stdout, poll, wait, send_signal, returncode), or, where the zygote cannot start, a
plain `subprocess.Popen` of `python -m corolla.cli.main`. The tests still run `corolla dht`, `generate`, `demo` and
`api --help` as fresh interpreters (test_cli, test_api_cli, tests/net), so the package's own import is covered.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import IO

# what `corolla serve` (with adapters or quantization), `corolla api` and `corolla monitor` import on their way
PRELOAD = ("corolla.cli.main", "corolla.server.server", "corolla.server.loading.blocks", "corolla.models", "peft",
           "bitsandbytes", "uvicorn", "corolla.api.app", "corolla.monitor.app")


# ------------------------------------------------------------------------------------------- in the zygote
def _zygote_main(control_fd: int) -> None:
    import importlib
    import select
    import signal

    for module in PRELOAD:
        importlib.import_module(module)
    control = socket.socket(fileno=control_fd)
    if threading.active_count() != 1:  # a thread would be lost in every child, with any lock it held
        control.send(json.dumps({"error": f"{threading.active_count()} threads after the imports"}).encode())
        return
    control.send(json.dumps({"ready": os.getpid()}).encode())
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([control], [], [], 0.1)
        if readable:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
            if not message:  # the test process is gone
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                control.close()
                _child(request, fds[0])
            os.close(fds[0])
            children.add(pid)
            control.send(json.dumps({"spawned": pid}).encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict, output_fd: int) -> None:
    import random
    import signal
    import traceback

    code = 1
    try:
        os.setsid()
        if request.get("netns"):
            _enter_netns(request["netns"])
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1):  # SIGPIPE stays ignored, as Python sets it
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.close(output_fd)
        os.close(devnull)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered: the caller reads lines as they come
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["corolla", *request["argv"]]
        random.seed()  # every sibling would draw the same numbers otherwise
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        from corolla.cli.main import main

        try:
            code = int(main(request["argv"]) or 0)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 (reported on the process's own output, as an interpreter would)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name` (`ip netns add` made it, as
    corolla.netemu's hosts do): its sockets, and its p2pd's, are then that host's. Python 3.11 has no os.setns."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- in the tests
class ForkedProcess:
    """A process the zygote forked, with the part of subprocess.Popen's interface LocalSwarm and the tests use."""

    def __init__(self, pid: int, args: list[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ZygoteClient:
    """The test process's end of the zygote: `spawn(argv, env)` forks a `corolla` process from it."""

    def __init__(self) -> None:
        """Start the zygote (its imports take a few seconds; `ready()` waits for them)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"import server_zygote; server_zygote._zygote_main({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])},
        )
        theirs.close()
        self._control = ours
        self._requesting = threading.Lock()  # one spawn request at a time: answers come back in order
        self._lock = threading.Lock()  # the processes by pid (the reader thread reports their exits)
        self._spawned: queue.Queue[dict] = queue.Queue()
        self._processes: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._ready: dict | None = None

    def ready(self, timeout: float = 120.0) -> None:
        """Wait until the zygote has imported everything; RuntimeError if it cannot (it exits)."""
        if self._ready is None:
            self._control.settimeout(timeout)
            try:
                self._ready = json.loads(self._control.recv(1 << 16) or b'{"error": "the zygote exited"}')
            except OSError as e:
                self._ready = {"error": f"{type(e).__name__}: {e}"}
            self._control.settimeout(None)
            if "ready" in self._ready:
                threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        if "ready" not in self._ready:
            raise RuntimeError(f"server zygote did not start: {self._ready.get('error')}")

    def _read(self) -> None:
        while True:
            try:
                message = self._control.recv(1 << 16)
            except OSError:
                return
            if not message:
                return
            event = json.loads(message)
            if "spawned" in event:
                self._spawned.put(event)
            elif "exited" in event:
                with self._lock:
                    process = self._processes.pop(event["exited"], None)
                    if process is None:
                        self._early_exits[event["exited"]] = event["code"]
                if process is not None:
                    process._exit(event["code"])

    def spawn(self, argv: list[str], env: dict[str, str], netns: str | None = None) -> ForkedProcess:
        """`corolla ARGV` with environment `env`, forked from the zygote (inside network namespace `netns` if given);
        its stdout and stderr together, as text."""
        self.ready()
        read_fd, write_fd = os.pipe()
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "netns": netns}
        try:
            with self._requesting:
                socket.send_fds(self._control, [json.dumps(request).encode()], [write_fd])
                pid = self._next_spawned()
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        process = ForkedProcess(pid, [sys.executable, "-m", "corolla.cli.main", *argv],
                                open(read_fd, encoding="utf-8", errors="replace"))
        with self._lock:
            self._processes[pid] = process
            early = self._early_exits.pop(pid, None)
        if early is not None:
            process._exit(early)
        return process

    def _next_spawned(self) -> int:
        while True:
            try:
                return self._spawned.get(timeout=1.0)["spawned"]
            except queue.Empty:
                if self._process.poll() is not None:
                    raise RuntimeError(f"server zygote exited with code {self._process.returncode}") from None

    def close(self) -> None:
        self._control.close()  # the zygote sees end of file and exits
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()


_client: ZygoteClient | None = None
_failed: str | None = None


def start() -> None:
    """Start the session's zygote without waiting for its imports (call early: they overlap other work)."""
    global _client, _failed
    if _client is None and _failed is None:
        try:
            _client = ZygoteClient()
        except Exception as e:  # noqa: BLE001 (any failure: fall back to plain processes)
            _failed = f"{type(e).__name__}: {e}"


def zygote() -> ZygoteClient | None:
    """The session's zygote once ready (started on first use); None where it cannot start (then spawn processes
    as usual)."""
    global _client, _failed
    start()
    if _client is not None:
        try:
            _client.ready()
        except Exception as e:  # noqa: BLE001
            _failed = f"{type(e).__name__}: {e}"
            _client.close()
            _client = None
    return _client


def start_corolla(argv: list[str], env: dict[str, str], netns: str | None = None):
    """`corolla ARGV` in a new session (its own process group) with environment `env`, stdout and stderr together
    as text, inside network namespace `netns` if given (an emulated host's, corolla.netemu): forked from the
    zygote, or a fresh `python -m corolla.cli.main` where there is none. Returns a subprocess.Popen or a
    ForkedProcess (the same interface, as far as the tests use it)."""
    client = zygote()
    if client is not None:
        return client.spawn(argv, env, netns)
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.Popen([*prefix, sys.executable, "-m", "corolla.cli.main", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)


def close() -> None:
    global _client
    if _client is not None:
        _client.close()
        _client = None
