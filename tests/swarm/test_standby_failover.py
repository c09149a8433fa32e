"""Standby replicas across real processes: kill -9 the primary of a span mid-generation with standby=1.

The session's second server of blocks 2:4 was fed every step; it is promoted when the primary dies, with no history
replayed, and greedy output equals the local HF model's.
"""

from __future__ import annotations

import signal

import torch
from transformers import LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM
from corolla.client.event_loop import run_sync

PROMPT = torch.tensor([[1, 11, 22, 33, 44]])
PREFERRED = ["--throughput", "1000"]  # routes go through this server while it is up
BACKUP = ["--throughput", "10"]


class KillAfter:
    """A streamer that SIGKILLs the session's primary of blocks 2:4 right after the `n`-th generated token."""

    def __init__(self, n: int, swarm, session):
        self.n, self.swarm, self.session = n, swarm, session
        self.seen, self.victim = -1, None

    def put(self, value):
        self.seen += 1
        if self.seen == self.n:
            self.victim = next(s.peer_id for s in self.session.route if (s.start, s.end) == (2, 4))
            name = next(name for name, peer in self.swarm.peer_ids.items() if peer == self.victim)
            self.swarm.local.kill(self.swarm.procs[name], signal.SIGKILL)

    def end(self):
        pass


def test_kill9_of_a_primary_with_a_standby_promotes_it_without_a_replay(start_swarm, tiny_llama_path):
    swarm = start_swarm(head=("0:2", []), tail=("2:4", PREFERRED), replica=("2:4", BACKUP))
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers)
    try:
        with model.inference_session(max_length=64, standby=1) as session:
            streamer = KillAfter(6, swarm, session)
            out = model.generate(PROMPT, max_new_tokens=16, session=session, streamer=streamer)
            route = [s.peer_id for s in session.route]
            assert streamer.victim == swarm.peer_ids["tail"]
            assert route == [swarm.peer_ids["head"], swarm.peer_ids["replica"]]
            assert session.standby_promotions == 1 and session.standby_replayed_positions == 0
            assert session.standby_missing >= 1  # nobody else holds 0:2
            assert session.standby_steps > 0 and session.standby_mismatches == 0
    finally:
        model.shutdown()
    assert torch.equal(out, expected)


def test_a_lying_standby_is_convicted_by_the_client_computing_the_span_and_never_promoted(start_swarm,
                                                                                           tiny_llama_path):
    """Spot checks off: the standby (--inject-fault corrupt, armed from the start) disagrees with the primary on
    every step; with no third holder of 2:4 the client computes the span itself (ClientConfig.verify_referee, on by
    default) and distrusts the standby, not the honest primary; output equals HF's."""
    swarm = start_swarm(head=("0:2", []), tail=("2:4", PREFERRED),
                        replica=("2:4", [*BACKUP, "--inject-fault", "corrupt"]))
    swarm.procs["replica"].popen.send_signal(signal.SIGUSR1)
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers)
    try:
        with model.inference_session(max_length=64, standby=1) as session:
            out = model.generate(PROMPT, max_new_tokens=16, session=session)
            run_sync(session.checks.drain(30.0))
            liar, honest = swarm.peer_ids["replica"], swarm.peer_ids["tail"]
            assert session.standby_mismatches >= 1 and not session.unverified
            assert session.manager.distrusted == {liar}
            assert honest not in session.manager.banned()
            assert [s.peer_id for s in session.route] == [swarm.peer_ids["head"], honest]
            assert session.checks.rewinds == [] and session.standby_promotions == 0
    finally:
        model.shutdown()
    assert torch.equal(out, expected)
