"""Runs one documentation page's snippets in order, as a reader following the page would, and cleans up after it.

Every snippet runs in the page's own working directory (files it writes, like `swarm.key`, stay there) with the
environment the test gives: `$MODEL`, `$PEERS`, `$DRAFT` for bash, the same names for Python (`PEERS` as a list of
multiaddrs), and the virtualenv's `corolla`, `python` and `mkdocs` first on PATH.

- bash: the whole block as one `bash -e -o pipefail` script, in its own process group; it must exit with 0 within
  the time limit. Its output is kept in the page's log.
- background bash: each command in its own process group, started once the previous one is ready (doc_snippets.READY);
  all of them are stopped (SIGTERM, then SIGKILL of the group) when the page ends, even when it failed.
- python: in one interpreter per page (doc_python_runner.py), so later snippets see what earlier ones defined.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from doc_snippets import READY, Snippet, background_commands, commands, exec_form

HERE = Path(__file__).resolve().parent
SNIPPET_TIMEOUT = 300.0  # seconds one foreground snippet may take
READY_TIMEOUT = 180.0  # seconds a background command may take to become ready
STOP_GRACE = 20.0  # seconds a stopped process group gets before SIGKILL


class SnippetFailed(AssertionError):
    pass


class PageRun:
    """The processes and the Python interpreter of one page; use as a context manager."""

    def __init__(self, workdir: Path, env: dict[str, str], names: dict[str, object]):
        self.workdir = workdir
        self.env = dict(env)
        self.names = dict(names)  # the Python snippets' given names
        self.log_path = workdir / "page.log"
        self.log = open(self.log_path, "a")
        self.background: list[subprocess.Popen] = []
        self.python: subprocess.Popen | None = None
        self.results: int | None = None  # the read end of the Python runner's results pipe

    def __enter__(self) -> PageRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, snippet: Snippet) -> None:
        """Run one runnable snippet; SnippetFailed (naming its page and line, with the output) if it fails."""
        self.log.write(f"\n===== {snippet.origin} ({snippet.mode})\n{snippet.code}-----\n")
        self.log.flush()
        start = time.monotonic()
        if snippet.lang == "python":
            self._run_python(snippet)
        elif snippet.mode == "background":
            self._start_background(snippet)
        else:
            self._run_bash(snippet)
        self.log.write(f"----- {snippet.origin}: {time.monotonic() - start:.1f} s\n")
        self.log.flush()

    # ------------------------------------------------------------------ bash
    def _run_bash(self, snippet: Snippet) -> None:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", snippet.code], cwd=self.workdir, env=self.env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=SNIPPET_TIMEOUT)
        except subprocess.TimeoutExpired:
            _stop_group(proc, grace=0)
            output = proc.communicate()[0]
            self._fail(snippet, f"still running after {SNIPPET_TIMEOUT:.0f}s", output)
        self.log.write(output)
        self.log.flush()
        if proc.returncode != 0:
            self._fail(snippet, f"exited with {proc.returncode}", output)

    def _start_background(self, snippet: Snippet) -> None:
        for command, argv in zip(commands(snippet.code), background_commands(snippet)):
            out_path = self.workdir / f"background-{len(self.background)}.log"
            with open(out_path, "w") as out:
                proc = subprocess.Popen(["bash", "-c", exec_form(command)], cwd=self.workdir, env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            self.background.append(proc)
            ready = READY[argv[1]]
            deadline = time.monotonic() + READY_TIMEOUT
            while not any(ready.search(line) for line in out_path.read_text().splitlines()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {READY_TIMEOUT:.0f}s"
                    self._fail(snippet, f"`{command}` {why}", out_path.read_text())
                time.sleep(0.1)
            self.log.write(f"ready: {command}\n")
            if argv[1] == "dht" and snippet.sets is not None:
                maddrs = [line for line in out_path.read_text().splitlines() if READY["dht"].match(line)]
                self._set(snippet.sets, maddrs)

    def _set(self, name: str, maddrs: list[str]) -> None:
        """$NAME (comma-separated) for bash, NAME (a list) for Python, from now on."""
        self.env[name] = ",".join(maddrs)
        self.names[name] = maddrs
        if self.python is not None:
            self._python_request({"set": {name: maddrs}}, Snippet("(harness)", 0, "python", "", "run"))

    # ------------------------------------------------------------------ python
    def _run_python(self, snippet: Snippet) -> None:
        if self.python is None:
            read_fd, write_fd = os.pipe()
            self.python = subprocess.Popen(
                [sys.executable, "-u", str(HERE / "doc_python_runner.py"), str(write_fd)], cwd=self.workdir,
                env={**self.env, "DOC_SNIPPET_NAMES": json.dumps(self.names)}, stdin=subprocess.PIPE,
                stdout=self.log, stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,), start_new_session=True)
            os.close(write_fd)
            self.results = read_fd
        self._python_request({"origin": snippet.origin, "code": snippet.code}, snippet)

    def _python_request(self, request: dict, snippet: Snippet) -> None:
        assert self.python is not None and self.python.stdin is not None and self.results is not None
        self.python.stdin.write(json.dumps(request) + "\n")
        self.python.stdin.flush()
        answer = b""
        deadline = time.monotonic() + SNIPPET_TIMEOUT
        while not answer.endswith(b"\n"):
            ready, _, _ = select.select([self.results], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.results, 1 << 16) if ready else b""
            if not chunk:
                why = "did not finish" if not ready else "the interpreter exited"
                self._fail(snippet, f"{why} (time limit {SNIPPET_TIMEOUT:.0f}s)", self._log_tail())
            answer += chunk
        result = json.loads(answer)
        if not result["ok"]:
            self._fail(snippet, "raised", result["error"])

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Stop the interpreter (it shuts its models down) and every background process, all at once."""
        start = time.monotonic()
        if self.python is not None:
            try:
                assert self.python.stdin is not None
                self.python.stdin.close()
                self.python.wait(timeout=60)
            except (subprocess.TimeoutExpired, OSError):
                pass
            _stop_group(self.python, grace=0)
            self.python = None
        if self.results is not None:
            os.close(self.results)
            self.results = None
        _stop_groups(list(reversed(self.background)), grace=STOP_GRACE)
        self.background.clear()
        self.log.write(f"----- stopped everything: {time.monotonic() - start:.1f} s\n")
        self.log.close()

    def _log_tail(self, chars: int = 6000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-chars:]

    def _fail(self, snippet: Snippet, why: str, output: str) -> None:
        raise SnippetFailed(f"{snippet.origin}: {why}\n--- snippet:\n{snippet.code}--- output (end):\n{output[-6000:]}")


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    _stop_groups([proc], grace)


def _stop_groups(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every process's group at once (SIGKILL with grace 0), then, `grace` seconds later at most, SIGKILL
    to each group: its stragglers (p2pd) even when the leader exited."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM if grace else signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + (grace or 10)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port` (the docs' fixed ports: API 8000, monitor 8080, ...)."""
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


FIXED_PORT = re.compile(r"(?:--port|--metrics-port)\s+(\d+)|127\.0\.0\.1:(\d+)")


def fixed_ports(snippets: list[Snippet]) -> set[int]:
    """The fixed TCP ports the page's runnable snippets listen on or talk to."""
    ports = set()
    for snippet in snippets:
        if snippet.runnable:
            for match in FIXED_PORT.finditer(snippet.code):
                port = int(match.group(1) or match.group(2))
                if port:
                    ports.add(port)
    return ports
