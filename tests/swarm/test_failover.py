"""A server killed mid-generation, with a replica of its blocks alive, changes nothing in the greedy output."""

from __future__ import annotations

import signal

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import SERVER_ARGS, _peer_id_from_log
from corolla import AutoDistributedModelForCausalLM
from corolla.cli.local_swarm import LocalSwarm


@pytest.fixture(scope="module")
def replicated_swarm(tiny_llama_path, tmp_path_factory):
    """Blocks 0:2 on one server, blocks 2:4 on two (a replica)."""
    with LocalSwarm(env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        peers = local.start_dht()
        specs = {"head": "0:2", "b1": "2:4", "b2": "2:4"}
        procs = {name: local.start_server(tiny_llama_path, ["--blocks", blocks, *SERVER_ARGS], name=name, wait=False) for name, blocks in specs.items()}
        for proc in procs.values():
            local.wait_ready(proc)
        by_peer = {_peer_id_from_log(p.tail(200)): p for p in procs.values()}
        yield local, peers, by_peer


class KillAfter:
    """A streamer that kills the server holding the session's last span after `n` generated tokens."""

    def __init__(self, n, session, local, by_peer):
        self.n, self.session, self.local, self.by_peer = n, session, local, by_peer
        self.seen, self.killed = -1, None

    def put(self, value):
        self.seen += 1
        if self.seen == self.n and self.killed is None:
            peer = self.session._spans[-1].span.peer_id
            self.killed = peer
            self.local.kill(self.by_peer[peer], signal.SIGKILL)

    def end(self):
        pass


def test_killing_a_server_mid_generation_keeps_greedy_output_identical(replicated_swarm, tiny_llama_path):
    local, peers, by_peer = replicated_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama_path, initial_peers=peers)
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    try:
        ids = torch.tensor([[1, 11, 22, 33, 44]])
        expected = reference.generate(ids, max_new_tokens=30, do_sample=False)
        with model.inference_session(max_length=64) as session:
            killer = KillAfter(10, session, local, by_peer)
            out = model.generate(ids, max_new_tokens=30, session=session, streamer=killer)
            assert killer.killed is not None
            assert all(s.span.peer_id != killer.killed for s in session._spans)
        assert torch.equal(out, expected)
    finally:
        model.shutdown()
