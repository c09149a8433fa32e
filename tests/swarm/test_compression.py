"""Compressed activations and pipelined prefill against real servers (a three-server push route): every codec's
outputs stay within its error of the exact ones, `none` stays exact; a prefill sent in chunks equals the one-shot
prefill within float tolerance and generates HF's greedy tokens; a server failing mid-pipeline changes nothing."""

from __future__ import annotations

import signal
import tempfile

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import TestSwarm, start_named_servers
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.protocol.codecs import CODECS
from test_failover import BACKUP, PREFERRED, ActAfter  # noqa: F401

THREE = {"first": "0:1", "middle": "1:3", "last": "3:4"}
PROMPT = torch.tensor([[1, *range(3, 43)]])  # 41 tokens
# largest relative error of the last hidden states allowed per codec (4 blocks, 3 hops each way)
MAX_ERROR = {"none": 1e-5, "deflate": 1e-5, "bf16": 3e-2, "fp16": 5e-3, "int8": 1.5e-1, "4bit": 1.0}


@pytest.fixture(scope="module")
def swarm(tiny_llama_path):
    servers = {name: ["--blocks", blocks] for name, blocks in THREE.items()}
    servers["middle-2"] = ["--blocks", THREE["middle"]]  # so spot checks have a checker for the middle span
    with TestSwarm(env={"COROLLA_CACHE": tempfile.mkdtemp(prefix="corolla-cache-")}) as local:
        yield start_named_servers(local, tiny_llama_path, servers)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    return LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def connect(swarm, **config):
    return AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers,
                                                           client_config=ClientConfig(**config))


def session_output(model, prompt: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The last block's output (1, T, H) for the prompt in one session step, and the session's pushed steps."""
    with model.inference_session(max_length=64) as session:
        out = session.step(model.embed(prompt))
        return out, session.pushed_steps


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_keeps_a_sessions_outputs_within_its_error_and_none_exact(swarm, reference, codec):
    with torch.no_grad():
        exact = reference.model(PROMPT).last_hidden_state  # after the final norm
    model = connect(swarm, compression=codec)
    try:
        out, pushed = session_output(model, PROMPT)
        normed = model.head.norm(out)
    finally:
        model.shutdown()
    error = float(((normed - exact).norm(dim=-1) / exact.norm(dim=-1)).max())
    assert pushed == 1 and error <= MAX_ERROR[codec], error


def test_a_pipelined_prefill_equals_the_one_shot_prefill_and_generates_hf_greedy(swarm, reference):
    one_shot = connect(swarm)
    chunked = connect(swarm, prefill_chunk_tokens=8)
    try:
        whole, _ = session_output(one_shot, PROMPT)
        pieces, pushed = session_output(chunked, PROMPT)
        out = chunked.generate(PROMPT, max_new_tokens=12)
    finally:
        one_shot.shutdown()
        chunked.shutdown()
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-4)
    assert pushed == 1
    assert torch.equal(out, reference.generate(PROMPT, max_new_tokens=12, do_sample=False))


def test_a_pipelined_prefill_with_int8_stays_within_the_codecs_error(swarm, reference):
    with torch.no_grad():
        exact = reference.model(PROMPT).last_hidden_state
    model = connect(swarm, compression="int8", prefill_chunk_tokens=8)
    try:
        out, _ = session_output(model, PROMPT)
        normed = model.head.norm(out)
    finally:
        model.shutdown()
    assert float(((normed - exact).norm(dim=-1) / exact.norm(dim=-1)).max()) <= MAX_ERROR["int8"]


def test_spot_checks_of_honest_servers_raise_no_alarm_under_int8(swarm, tmp_path, monkeypatch):
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path))
    model = connect(swarm, compression="int8", verify_rate=1.0, verify_seed=0)
    try:
        with model.inference_session(max_length=64) as session:
            model.generate(PROMPT, max_new_tokens=8, session=session)
            unverified = session.unverified
        reputation = model.reputation()
    finally:
        model.shutdown()
    assert sum(record["passed"] for record in reputation.values()) >= 2
    assert not any(record["failed"] or record["distrusted"] for record in reputation.values()), reputation
    assert not unverified


def test_unknown_compression_is_a_value_error(swarm):
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        connect(swarm, compression="zip")


def test_a_server_failing_in_the_middle_of_a_pipelined_prefill_changes_nothing(start_swarm, reference):
    servers = {name: (blocks, []) for name, blocks in THREE.items()}
    servers["middle"] = (THREE["middle"], [*PREFERRED, "--inject-fault", "fail"])
    servers["replica"] = (THREE["middle"], BACKUP)
    swarm = start_swarm(**servers)
    swarm.procs["middle"].popen.send_signal(signal.SIGUSR1)  # it fails every step from the first chunk on
    model = connect(swarm, prefill_chunk_tokens=8)
    try:
        with model.inference_session(max_length=64) as session:
            out = model.generate(PROMPT, max_new_tokens=12, session=session)
            peers = [s.peer_id for s in session.route]
    finally:
        model.shutdown()
    assert torch.equal(out, reference.generate(PROMPT, max_new_tokens=12, do_sample=False))
    assert peers == [swarm.peer_ids[name] for name in ("first", "replica", "last")]
