"""What the hostile-input tests (test_fuzz, test_churn) share: a swarm with short timeouts, honest clients that keep
generating meanwhile, and the checks that nothing was lost afterwards.

`start_hostile_swarm` runs two servers (blocks 0:2 and 2:4 of the tiny Llama) whose timeouts are a few seconds,
so streams that stall resolve within the test. `HonestClients` are two real clients (separate P2P nodes) that
generate greedily in threads until stopped, each output compared with the local HF model's. `ServerWatch` reads
what a server holds (rpc_info: sessions, free and total cache; /proc: its open file descriptors, one per open
stream, and threads) and waits for it to be back where it started.

Push streams: server a keeps one persistent rpc_push stream to b while clients push through it (a socket in each
server), which b ends after SESSION_TIMEOUT idle plus its linger (PUSH_IDLE_OUT). So a file descriptor count is
only comparable once no client has pushed for PUSH_IDLE_OUT: ServerWatch takes its baseline after that wait, and
`wait_settled` gives the servers that long too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import LlamaForCausalLM

from conftest import NamedSwarm, start_named_servers, wait_until
from corolla import AutoDistributedModelForCausalLM
from corolla.client.swarm.server_info import request_info
from corolla.dht.node import SwarmNode, create_swarm_node
from corolla.protocol.messages import InfoReply
from corolla.server.rpc.handler import LINGER_TIMEOUT
from raw_frames import fd_targets, open_fds, process_threads

SESSION_TIMEOUT = 3.0  # seconds: --session-timeout of the hostile swarm's servers (also bounds a silent new stream)
HOSTILE_ARGS = ["--session-timeout", str(SESSION_TIMEOUT), "--max-alloc-timeout", "2", "--cache-tokens", "32768"]
HIDDEN_SIZE = 64  # the tiny Llama's
PUSH_IDLE_OUT = SESSION_TIMEOUT + LINGER_TIMEOUT + 2.0  # seconds until an idle push stream is gone from both servers
PROMPTS = [[1, 4, 9, 16], [1, 7], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38], [1, 99, 5]]
NEW_TOKENS = 6


def start_hostile_swarm(local, model_path: str) -> NamedSwarm:
    """A DHT and servers "a" (blocks 0:2) and "b" (2:4) with HOSTILE_ARGS, both ready."""
    return start_named_servers(local, model_path, {
        "a": ["--blocks", "0:2", *HOSTILE_ARGS], "b": ["--blocks", "2:4", *HOSTILE_ARGS]})


class LoopNode:
    """A P2P node of the test's own, on an event loop in a thread of its own: `run` hands it coroutines."""

    def __init__(self, initial_peers: list[str]):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hostile-node", daemon=True)
        self._thread.start()
        self.node: SwarmNode = self.run(create_swarm_node(initial_peers, client_mode=True), timeout=120)
        self.p2p = self.node.p2p

    def run(self, coro, timeout: float = 600):
        """Run `coro` on the node's loop and return its result (its exception propagates)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.node.shutdown(), timeout=60)
            self.run(_cancel_others(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one (the P2P node leaves some behind) and wait for them."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class HonestClients:
    """Two clients generating greedily in threads until `stop()`; every output is compared with HF greedy."""

    model_path: str
    initial_peers: list[str]
    generations: list[int] = field(default_factory=lambda: [0, 0])
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        reference = LlamaForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
                         for p in PROMPTS]
        self.models = [AutoDistributedModelForCausalLM.from_pretrained(self.model_path, initial_peers=self.initial_peers)
                       for _ in range(2)]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def check_once(self) -> None:
        """One generation per client, in this thread (a warm-up, and the check after the storm)."""
        for index in range(2):
            self._generate(index, index)

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"honest-{i}", daemon=True) for i in range(2)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def shutdown(self) -> None:
        self.stop()
        for model in self.models:
            model.shutdown()

    def _loop(self, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            self._generate(index, turn)
            turn += 1

    def _generate(self, index: int, turn: int) -> None:
        prompt = turn % len(PROMPTS)
        model = self.models[index]
        try:
            if turn % 2:  # every other turn in an explicit session: half the tokens, then the rest by a second call
                with model.inference_session(max_length=32) as session:
                    out = model.generate(torch.tensor([PROMPTS[prompt]]), max_new_tokens=NEW_TOKENS // 2, session=session)
                    out = model.generate(out, max_new_tokens=NEW_TOKENS - NEW_TOKENS // 2, session=session)
            else:
                out = model.generate(torch.tensor([PROMPTS[prompt]]), max_new_tokens=NEW_TOKENS)
        except Exception as e:  # counted: an honest client must never fail
            self.failures.append(f"client {index}: {type(e).__name__}: {e}")
            return
        if not torch.equal(out, self.expected[prompt]):
            self.failures.append(f"client {index}: prompt {prompt} gave {out.tolist()}, HF {self.expected[prompt].tolist()}")
        self.generations[index] += 1


def idle_fds(swarm: NamedSwarm) -> dict[str, int]:
    """Per server of a swarm no client has used yet, the file descriptors it holds at rest (the fewest of a few
    looks, so that a stream of its own announcing is not counted)."""
    looks = []
    for _ in range(3):
        looks.append({name: open_fds(proc.pid) for name, proc in swarm.procs.items()})
        time.sleep(0.1)
    return {name: min(look[name] for look in looks) for name in swarm.procs}


def wait_push_streams_gone(swarm: NamedSwarm, at_rest: dict[str, int] | None) -> None:
    """Wait until no push stream is left open between the servers: every server back to its `at_rest` descriptor
    count (idle_fds), at most PUSH_IDLE_OUT seconds; without `at_rest`, PUSH_IDLE_OUT seconds."""
    if at_rest is None:
        time.sleep(PUSH_IDLE_OUT)
        return
    wait_until(lambda: all(open_fds(proc.pid) == at_rest[name] for name, proc in swarm.procs.items()),
               timeout=PUSH_IDLE_OUT, interval=0.2)


class ServerWatch:
    """What each server of a swarm holds, asked over a P2P node of the test's own (in its event loop). Its baseline
    is taken once no push stream is open (see the module doc): at once on servers back to `at_rest` (idle_fds)."""

    def __init__(self, swarm: NamedSwarm, node: LoopNode, at_rest: dict[str, int] | None = None):
        self.swarm = swarm
        self.node = node
        wait_push_streams_gone(swarm, at_rest)  # the baseline holds no push stream (see the module doc)
        self.baseline = {name: fd_targets(proc.pid) for name, proc in swarm.procs.items()}
        self.baseline_fds = {name: len(fds) for name, fds in self.baseline.items()}
        self.baseline_threads = {name: process_threads(proc.pid) for name, proc in swarm.procs.items()}

    def info(self, name: str) -> InfoReply:
        return self.node.run(request_info(self.node.p2p, self.swarm.peer_ids[name]), timeout=60)

    def settled(self) -> dict[str, str]:
        """Per server, what is not back to its start: open sessions, reserved cache, extra file descriptors."""
        problems = {}
        for name, proc in self.swarm.procs.items():
            info = self.info(name)
            # the answer's own stream stays open until the server sees our end closed, longer than a poll's interval
            # on a loaded machine: the count is read once it is gone (or after a few seconds)
            wait_until(lambda: open_fds(proc.pid) <= self.baseline_fds[name], timeout=3.0, interval=0.05)
            fds = open_fds(proc.pid)
            if (info.active_sessions, info.info.cache_tokens_free, fds) != (0, info.info.cache_tokens_total,
                                                                           self.baseline_fds[name]):
                problems[name] = (f"sessions {info.active_sessions}, cache free {info.info.cache_tokens_free} of "
                                  f"{info.info.cache_tokens_total}, fds {fds} (baseline {self.baseline_fds[name]}), "
                                  f"threads {process_threads(proc.pid)} (baseline {self.baseline_threads[name]}), "
                                  f"new fds {self._new_fds(name, proc.pid)}")
        return problems

    def _new_fds(self, name: str, pid: int) -> dict[str, str]:
        return {fd: target for fd, target in fd_targets(pid).items() if self.baseline[name].get(fd) != target}

    def wait_settled(self, timeout: float) -> dict[str, str]:
        """Wait up to `timeout` seconds for every server to hold nothing; returns what is still held (empty: all clear).
        The answer is the last check's: checking once more could catch a stream open for a moment (a client's ping)."""
        problems: dict[str, str] = {}

        def clear() -> bool:
            nonlocal problems
            problems = self.settled()
            return not problems

        wait_until(clear, timeout=timeout, interval=0.5)
        return problems


def log_problems(log_text: str) -> list[str]:
    """Lines of a swarm log that show a server bug: tracebacks, handler failures, asyncio's unretrieved errors."""
    marks = ("Traceback", "handler failed", "Task exception was never retrieved", "Exception in callback",
             "Task was destroyed but it is pending")
    return [line for line in log_text.splitlines() if any(mark in line for mark in marks)]

