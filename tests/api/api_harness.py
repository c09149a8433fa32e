"""A real swarm of the embedded demo model with `corolla api` processes in front of it (fixtures for
test_api_swarm.py, which imports them: a conftest.py here would shadow tests/conftest.py's `import conftest`).

- servers "a" (blocks 0:3) and "b" (3:6), 2048 cache tokens each, under the model's own DHT prefix;
- server "small" (0:6, 600 cache tokens) under the prefix "demo-small";
- `api_chat`: `corolla api` over a copy of the demo model whose tokenizer has a chat template (model name
  "demo-chat"), on servers a and b;
- `api_plain`: `corolla api` over the demo model itself (no chat template: the plain fallback) on the small server,
  keeping no finished sessions (--max-idle-sessions 0), so the small server's free cache shows what it holds.

Every process runs in its own process group and is ended, with its group, even when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from conftest import NamedSwarm, TestSwarm, start_named_servers
from server_zygote import start_corolla
from corolla.cli.demo_cmd import demo_model_path

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}")
URL_LINE = re.compile(r"(http://[^\s]+/v1)")


class ApiProcess:
    """`corolla api MODEL --initial-peers ... --port 0 ARGS`, its log, and its base URL once it logs it."""

    def __init__(self, model: str, peers: list[str], args: list[str], env: dict[str, str], ready_timeout: float = 180.0):
        self.log: deque[str] = deque(maxlen=400)
        self.popen = start_corolla(["api", model, "--initial-peers", *peers, "--port", "0", "--num-threads", "1", *args],
                                   {**os.environ, **env, "PYTHONUNBUFFERED": "1"})  # forked from the tests' zygote
        self._found = threading.Event()
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._found.wait(ready_timeout):
            self.close()
            raise RuntimeError("corolla api did not start:\n" + "\n".join(self.log))

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.log.append(line.rstrip("\n"))
            match = URL_LINE.search(line)
            if match and not self._found.is_set():
                self.url = match.group(1)
                self._found.set()

    @property
    def root(self) -> str:
        return self.url[: -len("/v1")]

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # p2pd and any straggler of the group
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(timeout=10)


@dataclass
class ApiSwarm:
    swarm: NamedSwarm
    model_path: str  # the demo model (no chat template)
    chat_path: str  # its copy with a chat template
    chat: ApiProcess  # model name "demo-chat", servers a and b
    plain: ApiProcess  # model name = model_path, the small server, no kept sessions
    env: dict[str, str]

    @property
    def peers(self) -> list[str]:
        return self.swarm.peers


@pytest.fixture(scope="session")
def api_swarm(tmp_path_factory: pytest.TempPathFactory):
    model = str(demo_model_path())
    chat_path = tmp_path_factory.mktemp("chat") / "demo-chat"
    shutil.copytree(model, chat_path)
    config_file = chat_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2))
    env = {"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    log_path = tmp_path_factory.mktemp("logs") / "api-swarm.log"
    apis: list[ApiProcess] = []
    with open(log_path, "w") as log, TestSwarm(log_file=log, env=env) as local:
        try:
            swarm = start_named_servers(local, model, {
                "a": ["--blocks", "0:3", "--cache-tokens", "2048"],
                "b": ["--blocks", "3:6", "--cache-tokens", "2048"],
                "small": ["--blocks", "0:6", "--cache-tokens", "600", "--dht-prefix", "demo-small"],
            })
            apis.append(ApiProcess(str(chat_path), swarm.peers, ["--model-name", "demo-chat", "--dht-prefix", "demo_model"], env))
            apis.append(ApiProcess(model, swarm.peers, ["--dht-prefix", "demo-small", "--max-idle-sessions", "0"], env))
            yield ApiSwarm(swarm, model, str(chat_path), apis[0], apis[1], env)
        finally:
            for api in apis:
                api.close()


@dataclass
class Reference:
    """The local HF model and its tokenizer: the oracle."""

    model: LlamaForCausalLM
    tokenizer: object

    @torch.inference_mode()
    def greedy(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
        """HF's greedy continuation of `ids`: the new token ids and their text (special tokens skipped)."""
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        new = out[0, len(ids):].tolist()
        return new, self.tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @torch.inference_mode()
    def logprobs(self, ids: list[int], new: list[int]) -> list[float]:
        """Log-probabilities of the tokens `new` after `ids`, by the model's full forward."""
        full = torch.tensor([ids + new])
        logp = torch.log_softmax(self.model(full).logits[0].float(), -1)
        return [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(new)]


@pytest.fixture(scope="session")
def reference() -> Reference:
    path = demo_model_path()
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Reference(model, AutoTokenizer.from_pretrained(path))


def wait_for(predicate, timeout: float, interval: float = 0.2):
    """Poll until predicate() is truthy (returns it) or `timeout` seconds pass (returns the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="session")
def free_cache(api_swarm):
    """free_cache(peer_id) -> (free, total) cache tokens, asked of the server itself (rpc_info)."""
    from corolla.client.event_loop import run_sync
    from corolla.client.swarm.server_info import request_info
    from corolla.dht import create_swarm_node

    node = run_sync(create_swarm_node(api_swarm.peers, client_mode=True))

    def ask(peer_id: str) -> tuple[int, int]:
        info = run_sync(request_info(node.p2p, peer_id)).info
        return info.cache_tokens_free, info.cache_tokens_total

    try:
        yield ask
    finally:
        run_sync(node.shutdown(), timeout=10)


def metric(api: ApiProcess, name: str, **labels: str) -> float:
    """One sample of the API's /metrics (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(api.root + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
