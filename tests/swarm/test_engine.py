"""The server engine over a real swarm: many sessions on one server, a full KV cache, and `--num-blocks`.

One DHT peer is shared by the whole module. Each scenario uses its own DHT prefix (`--dht-prefix`), so its servers
are invisible to the other scenarios' clients and the three swarms cost one DHT process; their servers start
together, once, at module set-up. Everything is compared with the local HF model (greedy, so exact).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import SERVER_ARGS, NamedSwarm, TestSwarm, start_named_servers, wait_until
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.event_loop import run_sync
from corolla.client.swarm.server_info import request_info
from corolla.protocol.errors import AllocationFailed, RemoteError
from corolla.protocol.messages import InfoReply
from corolla.server.presence.network import measure_peer

NUM_SESSIONS = 8
NEW_TOKENS = 20
FULL_CACHE_TOKENS = 64  # exactly one session of max_length 64, batch 1 (a session reserves batch * max_length)

# name -> (dht prefix, server args); each prefix is a separate swarm sharing the module's DHT
SERVERS: dict[str, tuple[str, list[str]]] = {
    "engine": ("engine", ["--blocks", "0:4"]),
    "full": ("full", ["--blocks", "0:4", "--cache-tokens", str(FULL_CACHE_TOKENS)]),
    "head": ("auto", ["--blocks", "0:2"]),  # blocks 2:4 of this swarm are left to a --num-blocks server
}


@pytest.fixture(scope="module")
def swarm(tiny_llama_path, tmp_path_factory) -> Iterator[NamedSwarm]:
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        yield start_named_servers(
            local, tiny_llama_path, {name: [*args, "--dht-prefix", prefix] for name, (prefix, args) in SERVERS.items()},
            ready_timeout=120,
        )


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@contextmanager
def client(swarm: NamedSwarm, prefix: str, **config) -> Iterator:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers, dht_prefix=prefix, torch_dtype=torch.float32,
        client_config=ClientConfig(**config) if config else None,
    )
    try:
        yield model
    finally:
        model.shutdown()


def server_info(model, peer_id: str) -> InfoReply:
    """The server's live view (sessions, free cache), straight from it rather than from its DHT record."""
    return run_sync(request_info(model.swarm_node.p2p, peer_id))


def cache_is_free(model, peer_id: str) -> bool:
    info = server_info(model, peer_id).info
    return info.cache_tokens_free == info.cache_tokens_total


def make_prompt(i: int) -> torch.Tensor:
    """Prompt i: a distinct prompt of 3 + i tokens (ids in [3, 128), after bos)."""
    return torch.tensor([[1, *((7 * i + 5 * j + 11) % 125 + 3 for j in range(2 + i))]])


# ---------------------------------------------------------------- many sessions on one server


class WaitForAll:
    """A streamer that, after the first generated token, waits until every session has one: at that moment all
    sessions are open on the server at once (none can finish before the barrier lets them all go)."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier, self.puts = barrier, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.barrier.wait()

    def end(self):
        pass


def test_eight_concurrent_sessions_on_one_server_each_equal_their_solo_run(swarm, reference):
    prompts = [make_prompt(i) for i in range(NUM_SESSIONS)]
    expected = [reference.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
    peer = swarm.peer_ids["engine"]
    with client(swarm, "engine") as model:  # one client for every thread: all its I/O runs on one event loop
        alone = [model.generate(p, max_new_tokens=NEW_TOKENS) for p in prompts]
        for i, (solo, hf) in enumerate(zip(alone, expected)):
            assert torch.equal(solo, hf), f"prompt {i} alone differs from HF"

        seen: list[InfoReply] = []
        start = threading.Barrier(NUM_SESSIONS, timeout=60)
        all_open = threading.Barrier(NUM_SESSIONS, action=lambda: seen.append(server_info(model, peer)), timeout=60)

        def run(i: int) -> torch.Tensor:
            start.wait()
            # the session object is passed explicitly (model.inference_session() would also work: it is per thread)
            with model.transformer.inference_session(max_length=prompts[i].shape[1] + NEW_TOKENS) as session:
                return model.generate(prompts[i], max_new_tokens=NEW_TOKENS, session=session, streamer=WaitForAll(all_open))

        before = server_info(model, peer)
        with ThreadPoolExecutor(NUM_SESSIONS) as pool:
            futures = [pool.submit(run, i) for i in range(NUM_SESSIONS)]
            together = [f.result(timeout=180) for f in futures]
        after = server_info(model, peer)
        batches, steps = after.decode_batches - before.decode_batches, after.decode_steps - before.decode_steps
        assert steps == NUM_SESSIONS * (NEW_TOKENS - 1)  # every decode step went through the batcher...
        assert batches < steps  # ...and some of them ran together (continuous batching across sessions)

        for i, (out, solo) in enumerate(zip(together, alone)):
            assert torch.equal(out, solo), f"prompt {i} differs when run alongside {NUM_SESSIONS - 1} others"
        assert len(seen) == 1
        reserved = sum(p.shape[1] + NEW_TOKENS for p in prompts)
        assert seen[0].active_sessions == NUM_SESSIONS
        assert seen[0].info.cache_tokens_free == seen[0].info.cache_tokens_total - reserved
        assert wait_until(lambda: cache_is_free(model, peer), timeout=10), "a session's cache was not released"


# ---------------------------------------------------------------- a full server


def test_full_server_refuses_a_second_session_clearly_and_serves_it_once_freed(swarm, reference):
    peer = swarm.peer_ids["full"]
    first, second = make_prompt(0), make_prompt(3)
    with client(swarm, "full") as holder, client(swarm, "full", alloc_timeout=1.0, max_retries=2) as other:
        with holder.transformer.inference_session(max_length=64) as held:
            holder.generate(first, max_new_tokens=5, session=held)
            assert server_info(holder, peer).info.cache_tokens_free == 0

            begin = time.perf_counter()
            # a refusal is retried like any server failure (ban, backoff, re-route) and then surfaces as
            # AllocationFailed wrapping the server's server_full error
            with other.transformer.inference_session(max_length=64) as refused, \
                    pytest.raises(AllocationFailed, match="server full") as error:
                other.generate(second, max_new_tokens=5, session=refused)
            waited = time.perf_counter() - begin
            cause = error.value.__cause__
            assert isinstance(cause, RemoteError) and cause.code == "server_full" and cause.peer == peer
            assert f"could not reserve 64 cache tokens within 1.0s (free 0 of {FULL_CACHE_TOKENS})" in str(error.value)
            assert 1.0 <= waited < 30.0, f"the refusal took {waited:.1f}s"

            # the session holding the cache is unaffected: it goes on to what HF generates
            out = holder.generate(max_new_tokens=5, session=held)  # continues the session: only the new tokens
            assert torch.equal(out, reference.generate(first, max_new_tokens=10, do_sample=False)[:, first.shape[1] + 5:])

        assert wait_until(lambda: cache_is_free(holder, peer), timeout=10), "the closed session's cache was not released"
        with other.transformer.inference_session(max_length=64) as session:
            out = other.generate(second, max_new_tokens=NEW_TOKENS, session=session)
        assert torch.equal(out, reference.generate(second, max_new_tokens=NEW_TOKENS, do_sample=False))


# ---------------------------------------------------------------- --num-blocks, network probe


def test_network_probe_measures_bandwidth_to_a_server(swarm):
    with client(swarm, SERVERS["engine"][0]) as model:
        bandwidth = run_sync(measure_peer(model.swarm_node.p2p, swarm.peer_ids["engine"], payload_bytes=1 << 20))
        with pytest.raises(ValueError):
            run_sync(measure_peer(model.swarm_node.p2p, swarm.peer_ids["engine"], payload_bytes=0))
        assert server_info(model, swarm.peer_ids["engine"]).active_sessions == 0  # still serving
    assert 10e6 < bandwidth < 1e12, bandwidth  # bytes/s over loopback


def test_server_given_only_num_blocks_takes_the_blocks_nobody_serves(swarm, reference):
    prefix = SERVERS["head"][0]
    args = ["--num-blocks", "2", "--dht-prefix", prefix, *SERVER_ARGS]
    proc = swarm.local.start_server(swarm.model_path, args, name="tail", timeout=120)
    assert proc.blocks == "2:4", proc.tail(200)
    # it measured its network against the one server already in its swarm (loopback: far above 100 Mbit/s)
    network = next(line for line in proc.tail(200).splitlines() if "network: " in line)
    assert float(network.split("network: ")[1].split()[0]) > 100, network

    prompt = make_prompt(5)
    with client(swarm, prefix) as model, model.transformer.inference_session(max_length=prompt.shape[1] + NEW_TOKENS) as session:
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, session=session)
        route = [(s.peer_id, s.start, s.end) for s in session.route]
    assert torch.equal(out, reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False))
    assert route == [(swarm.peer_ids["head"], 0, 2), (proc.peer_id, 2, 4)]
