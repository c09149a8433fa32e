"""A process running inside an emulated host: its own process group, its output kept line by line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Sequence

STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL


@dataclass(eq=False)
class HostProcess:
    name: str
    popen: subprocess.Popen[str]
    log: deque[str] = field(default_factory=lambda: deque(maxlen=2000))
    stamps: deque[float] = field(default_factory=lambda: deque(maxlen=2000))  # time.monotonic() of each log line
    started: float = field(default_factory=time.monotonic)  # when the process was spawned (time.monotonic())
    log_file: IO[str] | None = None
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _printed: int = field(default=0, init=False)  # lines printed so far (the log keeps the last 2000)
    _done: bool = field(default=False, init=False)  # the output pipe reached its end

    @classmethod
    def start(cls, name: str, argv: Sequence[str], env: dict[str, str], log_file: IO[str] | None = None,
              stdin: bool = False) -> HostProcess:
        """Start `argv` in a new session (its own process group); with `stdin`, `send()` writes to its input."""
        popen = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )
        proc = cls(name, popen, log_file=log_file)
        threading.Thread(target=proc._pump, name=f"log-{name}", daemon=True).start()
        return proc

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(list(self.log)[-lines:])

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first match of regex `pattern` in output lines number `start` onwards (counting from the first line
        ever printed); RuntimeError when the process exits or `timeout` seconds pass first."""
        return self.wait_for_line(pattern, timeout, start)[0]

    def wait_for_line(self, pattern: str, timeout: float, start: int = 0) -> tuple[re.Match[str], float]:
        """As wait_for, and when the matching line was printed (time.monotonic())."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                lines, stamps = list(self.log), list(self.stamps)
                offset = self._printed - len(lines)
                for i in range(max(0, start - offset), len(lines)):
                    match = regex.search(lines[i])
                    if match:
                        return match, stamps[i]
                left = deadline - time.monotonic()
                if left <= 0 or (not self.alive() and self._done):
                    state = "timed out" if left <= 0 else f"exited with {self.popen.returncode}"
                    raise RuntimeError(f"{self.name} {state} before printing /{pattern}/:\n{self.tail()}")
                self._changed.wait(min(left, 0.5))

    @property
    def lines_printed(self) -> int:
        """How many lines the process has printed so far (a `start` for wait_for that skips them)."""
        with self._changed:
            return self._printed

    def send(self, line: str) -> None:
        """Write one line to the process's stdin (started with stdin=True)."""
        if self.popen.stdin is None:
            raise RuntimeError(f"{self.name} was started without stdin")
        self.popen.stdin.write(line.rstrip("\n") + "\n")
        self.popen.stdin.flush()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM to the process (it shuts its own p2pd down), then SIGKILL to its whole group after `grace`
        seconds (stragglers such as p2pd go too). Returns the exit code."""
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    # ------------------------------------------------------------------ output
    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            with self._changed:
                self.log.append(line)
                self.stamps.append(time.monotonic())
                self._printed += 1
                self._changed.notify_all()
            if self.log_file is not None:
                try:
                    self.log_file.write(f"[{self.name}] {line}\n")
                    self.log_file.flush()
                except ValueError:  # the log file was closed
                    pass
        with self._changed:
            self._done = True
            self._changed.notify_all()
