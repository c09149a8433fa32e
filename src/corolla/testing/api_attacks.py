"""Attacks on `corolla api` from callers among many (docs/security.md, "An API caller"): a hostile request beside
honest streams, requests without or with a wrong key, an oversized body, a foreign Host. Each runs against a real
`corolla api` process (with an API-keys file) in front of a running swarm of a model that has a tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from corolla.testing.results import AttackResult

URL_LINE = re.compile(r"(http://[^\s]+/v1)")
KEYS = ("key-alice-0123456789", "key-mallory-9876543210")


class ApiProcess:
    """`corolla api MODEL --initial-peers ... --port 0 ARGS` in a process group of its own; `url` once it serves."""

    def __init__(self, model: str, peers: list[str], args: list[str], ready_timeout: float = 180.0):
        self.log: deque[str] = deque(maxlen=400)
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "corolla.cli.main",
                "api",
                model,
                "--initial-peers",
                ",".join(peers),
                "--port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.url = ""
        found = threading.Event()

        def pump() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                self.log.append(line.rstrip("\n"))
                match = URL_LINE.search(line)
                if match and not self.url:
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(ready_timeout):
            self.close()
            raise RuntimeError("corolla api did not start:\n" + "\n".join(self.log))

    def close(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def request(
    url: str,
    body: dict | bytes | None = None,
    key: str | None = None,
    headers: dict | None = None,
    timeout: float = 120.0,
) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a POST (with `body`) or GET."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="POST" if data is not None else "GET",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def api_attacks(model: str, peers: list[str], workdir: Path) -> list[AttackResult]:
    """Run every API attack against one `corolla api` with two keys; the results in order."""
    keys_file = workdir / "api-keys"
    keys_file.write_text("# bench keys\n" + "\n".join(KEYS) + "\n")
    api = ApiProcess(model, peers, ["--api-keys", str(keys_file), "--max-body-bytes", str(1 << 20)])
    results = []
    try:
        base = api.url
        honest_body = {"model": model, "prompt": "The file system", "max_tokens": 8, "temperature": 0}
        status, alone = request(f"{base}/completions", honest_body, KEYS[0])
        expected = alone.get("choices", [{}])[0].get("text") if status == 200 else None

        statuses = [request(f"{base}/models")[0], request(f"{base}/completions", honest_body, "not-a-key")[0]]
        results.append(
            AttackResult(
                "api without a valid key",
                statuses != [401, 401],
                f"no key: HTTP {statuses[0]}, a wrong key: HTTP {statuses[1]}",
            )
        )

        hostile = [
            {**honest_body, "top_k": 2**63},
            {**honest_body, "logit_bias": {"²": 5}},
            {**honest_body, "n": 10**6},
            {**honest_body, "max_tokens": 2**40},
        ]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            honest = [pool.submit(request, f"{base}/completions", honest_body, KEYS[0]) for _ in range(3)]
            bad = [pool.submit(request, f"{base}/completions", body, KEYS[1]) for body in hostile]
            honest_answers = [f.result() for f in honest]
            bad_statuses = [f.result()[0] for f in bad]
        texts = [answer.get("choices", [{}])[0].get("text") for status, answer in honest_answers if status == 200]
        hurt = (
            len(texts) != len(honest) or any(text != expected for text in texts) or any(s != 400 for s in bad_statuses)
        )
        results.append(
            AttackResult(
                "api hostile parameters in a shared batch",
                hurt,
                f"hostile requests: HTTP {bad_statuses}; honest streams beside them: "
                f"{len(texts)}/{len(honest)} answered, all equal to the one run alone: "
                f"{all(text == expected for text in texts)}",
            )
        )

        status, _ = request(f"{base}/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', KEYS[1])
        results.append(AttackResult("api oversized body", status != 413, f"a 2 MiB body: HTTP {status}"))
        status, _ = request(f"{base}/models", key=KEYS[0], headers={"Host": "attacker.example"})
        results.append(AttackResult("api foreign Host (DNS rebinding)", status not in (400, 421), f"HTTP {status}"))
    finally:
        api.close()
    return results
