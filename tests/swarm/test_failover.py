"""Sessions survive server failures: every way a server can fail mid-generation, with and without a replica.

Each test starts its own small swarm (the failure consumes a server) and triggers the failure from a streamer at
a chosen token, so nothing sleeps: kill -9, SIGTERM (a clean shutdown announcing OFFLINE), and the server's
fault-injection hook (`--inject-fault fail|drop|stall`, armed by SIGUSR1). `--inject-fault corrupt` fails nothing
at all: it makes a server's outputs subtly wrong, which only checking the numbers can tell.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import NamedSwarm, wait_until
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.protocol.errors import MissingBlocks

PROMPT = torch.tensor([[1, 11, 22, 33, 44]])
PREFERRED = ["--throughput", "1000"]  # routes go through this server while it is up
BACKUP = ["--throughput", "10"]


@pytest.fixture(scope="module")
def expected(tiny_llama_path) -> torch.Tensor:
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    return reference.generate(PROMPT, max_new_tokens=30, do_sample=False)


class ActAfter:
    """A streamer that calls `action()` once, right after the `n`-th generated token, and times the next token."""

    def __init__(self, n: int, action: Callable[[], None]):
        self.n, self.action = n, action
        self.seen, self.acted_at, self.recovered_after = -1, None, None

    def put(self, value):
        self.seen += 1
        if self.acted_at is not None and self.recovered_after is None:
            self.recovered_after = time.perf_counter() - self.acted_at
        if self.seen == self.n:
            self.action()
            self.acted_at = time.perf_counter()

    def end(self):
        pass


@contextmanager
def client(swarm: NamedSwarm, **config) -> Iterator:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers, client_config=ClientConfig(**config) if config else None)
    try:
        yield model
    finally:
        model.shutdown()


def generate_with(model, streamer: ActAfter) -> tuple[torch.Tensor, list[str]]:
    """30 greedy tokens in one session; returns them and the peer ids the session ended on."""
    with model.inference_session(max_length=64) as session:
        out = model.generate(PROMPT, max_new_tokens=30, session=session, streamer=streamer)
        return out, [s.peer_id for s in session.route]


def test_kill9_mid_generation_with_a_replica_keeps_greedy_output_identical(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), tail=("2:4", PREFERRED), replica=("2:4", BACKUP))
    with client(swarm) as model:
        streamer = ActAfter(10, lambda: swarm.local.kill(swarm.procs["tail"], signal.SIGKILL))
        out, final_peers = generate_with(model, streamer)
    assert torch.equal(out, expected)
    assert final_peers == [swarm.peer_ids["head"], swarm.peer_ids["replica"]]


@pytest.mark.slow  # the failover matrix: the default run kills with one replica (above)
def test_failed_span_is_taken_over_by_two_smaller_servers(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), tail=("2:4", PREFERRED), left=("2:3", BACKUP), right=("3:4", BACKUP))
    with client(swarm) as model:
        streamer = ActAfter(10, lambda: swarm.local.kill(swarm.procs["tail"], signal.SIGKILL))
        out, final_peers = generate_with(model, streamer)
    assert torch.equal(out, expected)
    assert final_peers == [swarm.peer_ids[name] for name in ("head", "left", "right")]


@pytest.mark.parametrize("fault", ["fail", pytest.param("drop", marks=pytest.mark.slow),  # test_push: drop
                                   pytest.param("stall", marks=pytest.mark.slow)])
def test_server_that_fails_drops_or_stalls_a_step_is_routed_around(start_swarm, expected, fault):
    swarm = start_swarm(head=("0:2", []), faulty=("2:4", [*PREFERRED, "--inject-fault", fault]), replica=("2:4", BACKUP))
    step_timeout = 3.0
    with client(swarm, request_timeout=step_timeout) as model:
        streamer = ActAfter(10, lambda: swarm.procs["faulty"].popen.send_signal(signal.SIGUSR1))
        out, final_peers = generate_with(model, streamer)
    assert torch.equal(out, expected)
    assert final_peers == [swarm.peer_ids["head"], swarm.peer_ids["replica"]]
    assert "injecting fault" in swarm.procs["faulty"].tail(400)
    if fault == "stall":  # abandoned after the step timeout, not before and not much later
        assert step_timeout <= streamer.recovered_after < step_timeout + 5
    else:
        assert streamer.recovered_after < 2.0


def test_corrupt_fault_changes_outputs_after_sigusr1_and_not_before(start_swarm, tiny_llama_path):
    swarm = start_swarm(head=("0:2", []), corrupt=("2:4", ["--inject-fault", "corrupt"]))
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    with client(swarm) as model, torch.no_grad():
        expected = reference(PROMPT).logits
        embeds = model.head.embed(PROMPT)  # (1, T, H)

        def session_output() -> torch.Tensor:  # the hidden states the corrupt server answers a session step with
            with model.inference_session(max_length=16) as session:
                return session.step(embeds)

        clean = session_output()
        assert torch.allclose(model(PROMPT).logits, expected, atol=1e-4, rtol=0)
        assert torch.allclose(session_output(), clean, atol=1e-5, rtol=0)  # nothing changes before SIGUSR1
        swarm.procs["corrupt"].popen.send_signal(signal.SIGUSR1)
        assert wait_until(lambda: not torch.allclose(session_output(), clean, atol=1e-4, rtol=0), timeout=30)
        half = clean.shape[-1] // 2
        corrupt = session_output()
        torch.testing.assert_close(corrupt[..., :half], clean[..., :half] * 1.01, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(corrupt[..., half:], clean[..., half:], atol=1e-5, rtol=1e-5)
        logits = model(PROMPT).logits  # the forward path too: wrong, but only subtly
        assert 1e-3 < (logits - expected).abs().max() < 0.1 * expected.abs().max()
    assert all(proc.alive() for proc in swarm.procs.values())


def test_clean_shutdown_moves_sessions_without_an_error(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), leaving=("2:4", PREFERRED), replica=("2:4", BACKUP))
    leaving = swarm.procs["leaving"]
    with client(swarm) as model:
        streamer = ActAfter(10, lambda: leaving.popen.send_signal(signal.SIGTERM))  # the server alone, as a user would
        out, final_peers = generate_with(model, streamer)
    assert torch.equal(out, expected)
    assert final_peers == [swarm.peer_ids["head"], swarm.peer_ids["replica"]]
    leaving.popen.wait(timeout=30)
    assert "announced OFFLINE" in leaving.tail(400)


def test_without_a_replica_the_user_gets_missing_blocks_quickly(start_swarm):
    swarm = start_swarm(head=("0:2", []), tail=("2:4", []))
    with client(swarm) as model:
        streamer = ActAfter(5, lambda: swarm.local.kill(swarm.procs["tail"], signal.SIGKILL))
        with pytest.raises(MissingBlocks) as error:
            generate_with(model, streamer)
        waited = time.perf_counter() - streamer.acted_at
    assert error.value.blocks == [2, 3]
    assert waited < 15.0, f"MissingBlocks took {waited:.1f}s"
