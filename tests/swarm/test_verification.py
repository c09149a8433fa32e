"""Spot checks against real servers (ClientConfig.verify_rate): a `corrupt` server is caught and generation is
rewound so the output stays HF's, a lying checker is caught by a third opinion, honest servers of mixed dtype and
quantization (checked in their own kinds, by float32 servers computing as them) raise no alarm. More liars:
test_hostile_servers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import NamedSwarm
from corolla import AutoDistributedModelForCausalLM, ClientConfig

PROMPT = torch.tensor([[1, 11, 22, 33, 44]])
NEW_TOKENS = 40
PREFERRED = ["--throughput", "1000"]  # routes go through this server while it is trusted
# 1, not 10: routes draw holders weighted by blocks served per second of price, and a server is priced at its
# announced step time when that is more than 1 / throughput: on a loaded machine the preferred server then lost
# enough of its lead over a 10 to be left out of the draw about one time in ten (the corrupt one never served)
BACKUP = ["--throughput", "1"]


@pytest.fixture(autouse=True)
def client_cache(tmp_path, monkeypatch):
    """The client's reputation file goes to this test's directory."""
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path / "client-cache"))


@pytest.fixture(scope="module")
def expected(tiny_llama_path) -> torch.Tensor:
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    return reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


class ArmAt:
    """A streamer that sends SIGUSR1 to a process right after the n-th generated token."""

    def __init__(self, n: int, proc):
        self.n, self.proc, self.seen = n, proc, -1

    def put(self, value):
        self.seen += 1
        if self.seen == self.n:
            self.proc.popen.send_signal(signal.SIGUSR1)

    def end(self):
        pass


def generate(swarm: NamedSwarm, streamer=None, **config) -> tuple[torch.Tensor, dict, list[str], list[int]]:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers,
        # a ping slower than ping_timeout marks a server unreachable (never a checker): loaded test machines are slow
        client_config=ClientConfig(ping_timeout=10.0, **config))
    try:
        with model.inference_session(max_length=64) as session:
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session, streamer=streamer)
            peers = [s.peer_id for s in session.route]
            rewinds = session.checks.rewinds
        return out, model.reputation(), peers, rewinds
    finally:
        model.shutdown()


def test_corrupt_server_is_banned_and_output_equals_hf_greedy(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), corrupt=("2:4", [*PREFERRED, "--inject-fault", "corrupt"]),
                        honest=("2:4", BACKUP), third=("2:4", BACKUP))
    out, reputation, peers, rewinds = generate(swarm, ArmAt(3, swarm.procs["corrupt"]), verify_rate=0.1, verify_seed=3)
    assert torch.equal(out, expected)
    assert rewinds == [0]  # the corrupt server served the session from its first position
    corrupt = swarm.peer_ids["corrupt"]
    assert reputation[corrupt]["distrusted"] and reputation[corrupt]["failed"] >= 1
    assert corrupt not in peers
    assert not any(rec["distrusted"] for peer, rec in reputation.items() if peer != corrupt)
    status = subprocess.run(  # the record the client left under COROLLA_CACHE, in `corolla status`
        [sys.executable, "-m", "corolla.cli.main", "status", "--initial-peers", *swarm.peers, "--model", swarm.model_path],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=os.environ)
    assert status.returncode == 0, status.stderr
    line = next(line for line in status.stdout.splitlines() if corrupt in line)
    assert f"checks {reputation[corrupt]['passed']}/{reputation[corrupt]['failed']}  DISTRUSTED" in line


def test_lying_checker_is_banned_by_the_tie_breaker_and_the_session_keeps_its_server(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), main=("2:4", PREFERRED),
                        liar=("2:4", [*BACKUP, "--inject-fault", "corrupt"]), third=("2:4", BACKUP))
    swarm.procs["liar"].popen.send_signal(signal.SIGUSR1)
    out, reputation, peers, rewinds = generate(swarm, verify_rate=1.0, verify_seed=0)
    assert torch.equal(out, expected)
    assert rewinds == []
    liar, main = swarm.peer_ids["liar"], swarm.peer_ids["main"]
    assert reputation[liar]["distrusted"]
    assert not reputation[main]["distrusted"] and reputation[main]["failed"] == 0
    assert peers == [swarm.peer_ids["head"], main]


def test_honest_servers_of_mixed_dtype_and_quantization_raise_no_alarm(start_swarm):
    swarm = start_swarm(a=("0:2", []), b=("0:2", ["--dtype", "bfloat16"]), c=("2:4", []),
                        d=("2:4", ["--quant", "int8"]), e=("2:4", ["--quant", "nf4"]))
    _, reputation, _, rewinds = generate(swarm, verify_rate=1.0, verify_seed=0)
    assert reputation and sum(rec["passed"] for rec in reputation.values()) >= 10
    assert all(rec["failed"] == 0 and not rec["distrusted"] for rec in reputation.values()), reputation
    assert rewinds == []


def test_without_a_third_holder_the_client_computes_the_span_itself_and_convicts_the_server_in_use(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), corrupt=("2:4", [*PREFERRED, "--inject-fault", "corrupt"]),
                        honest=("2:4", BACKUP))
    swarm.procs["corrupt"].popen.send_signal(signal.SIGUSR1)
    # rate 0.01: only the first step of a never-checked server is sure to be checked
    out, reputation, peers, rewinds = generate(swarm, verify_rate=0.01, verify_seed=0)
    assert torch.equal(out, expected)
    corrupt = swarm.peer_ids["corrupt"]
    assert reputation.get(corrupt, {}).get("distrusted") and rewinds == [0], (reputation, swarm.peer_ids, rewinds)
    assert peers == [swarm.peer_ids["head"], swarm.peer_ids["honest"]]
    assert not reputation.get(swarm.peer_ids["honest"], {}).get("distrusted")  # the checker is neither blamed nor credited


@pytest.mark.parametrize("passes_in_flight", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_speculative_decoding_rewinds_after_a_corrupt_server_and_equals_hf_greedy(start_swarm, expected,
                                                                                   passes_in_flight):
    """Spot checks during speculative decoding, sequential and with passes in flight: the corrupt server's outputs
    are found, every pass in flight cancelled, the session rewound and the tokens generated again."""
    swarm = start_swarm(head=("0:2", []), corrupt=("2:4", [*PREFERRED, "--inject-fault", "corrupt"]),
                        honest=("2:4", BACKUP), third=("2:4", BACKUP))
    model = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers, client_config=ClientConfig(ping_timeout=10.0, verify_rate=1.0))
    try:
        with model.inference_session(max_length=64) as session:
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session, prompt_lookup_num_tokens=3,
                                 passes_in_flight=passes_in_flight, streamer=ArmAt(3, swarm.procs["corrupt"]))
            peers = [s.peer_id for s in session.route]
            rewinds = session.checks.rewinds
    finally:
        model.shutdown()
    assert torch.equal(out, expected)
    assert rewinds and swarm.peer_ids["corrupt"] not in peers
