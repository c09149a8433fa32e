"""Speculative decoding through a real swarm: several tokens per round trip, the same tokens as plain decoding.

The demo model's 6 blocks on two float32 servers (shared with test_sessions), with the shipped draft
(corolla/demo_draft) and prompt lookup as drafters; plain greedy through the same swarm and HF's `generate` on the local model are the oracles. Then the
other families (test_families' swarms, shared), each with the local HF model itself as the assistant
(every draft kept: the longest steps) and with prompt lookup (mostly rejected: the most rollbacks).
"""

from __future__ import annotations

import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import TestSwarm, start_named_servers
from corolla import AutoDistributedModelForCausalLM
from corolla.cli.demo_cmd import demo_draft_path
from corolla.cli.main import build_parser
from test_families import VOCAB, start_family_swarm

TEXT = ("The file system keeps a list of the blocks of each file. The file system keeps a list of the free blocks. "
        "When a file grows, the file system")


@pytest.fixture(scope="module")
def demo(demo_swarm):
    """The demo model on two servers (0:3, 3:6), a float32 client, the shipped draft, the local HF model."""
    swarm = demo_swarm
    path = swarm.model_path
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=swarm.peers, dtype=torch.float32)
    try:
        yield dict(model=model, tokenizer=AutoTokenizer.from_pretrained(path), path=path, peers=swarm.peers,
                   reference=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                   draft=AutoModelForCausalLM.from_pretrained(str(demo_draft_path()), dtype=torch.float32).eval())
    finally:
        model.shutdown()


@pytest.fixture
def model(demo):
    return demo["model"]


def ids_of(demo, text: str) -> torch.Tensor:
    return demo["tokenizer"](text, return_tensors="pt")["input_ids"]


def speculations(demo) -> dict[str, dict]:
    return {"draft": dict(assistant_model=demo["draft"]), "lookup": dict(prompt_lookup_num_tokens=6)}


class Recorder:
    """A streamer that keeps every put."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.tolist())

    def end(self) -> None:
        self.ended += 1


def test_long_greedy_generations_equal_plain_greedy_in_fewer_round_trips(demo, model):
    prompts = [TEXT, "Human: What is a file system?\nAssistant:"]
    for text in prompts:
        ids = ids_of(demo, text)
        with model.inference_session(max_length=ids.shape[1] + 128) as session:
            plain = model.generate(ids, max_new_tokens=128, session=session)
            plain_steps = session.steps
        assert torch.equal(plain, demo["reference"].generate(ids, max_new_tokens=128, do_sample=False))
        for name, kwargs in speculations(demo).items():
            with model.inference_session(max_length=ids.shape[1] + 128) as session:
                out = model.generate(ids, max_new_tokens=128, session=session, **kwargs)
                assert torch.equal(out, plain), f"{name} on {text!r} differs from plain greedy"
                assert session.steps < plain_steps, f"{name} took {session.steps} round trips, plain {plain_steps}"
                assert session.position == out.shape[1] - 1  # as after plain decoding: all but the last token sent


def test_a_two_turn_session_equals_plain_with_a_repetition_penalty(demo, model):
    tokenizer = demo["tokenizer"]
    for name, kwargs in speculations(demo).items():
        conversation, replies = "", []
        with model.inference_session(max_length=400) as session:
            for user in ["What is a file system?", "How do I copy a file?"]:
                conversation += f"Human: {user}\nAssistant:"
                inputs = ids_of(demo, conversation)
                out = model.generate(inputs, session=session, max_new_tokens=60, repetition_penalty=1.2, **kwargs)
                expected = demo["reference"].generate(inputs, max_new_tokens=60, do_sample=False, repetition_penalty=1.2)
                assert torch.equal(out, expected), f"{name}: a turn differs from HF on the same ids"
                conversation = tokenizer.decode(out[0], skip_special_tokens=True) + "\n"
                replies.append(out)
            assert session.position == replies[-1].shape[1] - 1


def test_the_streamer_sees_what_plain_decoding_shows_it(demo, model):
    ids = ids_of(demo, TEXT)
    plain = Recorder()
    model.generate(ids, max_new_tokens=40, streamer=plain)
    for name, kwargs in speculations(demo).items():
        streamer = Recorder()
        model.generate(ids, max_new_tokens=40, streamer=streamer, **kwargs)
        assert streamer.puts == plain.puts and streamer.ended == 1, name


def test_eos_and_length_edges_equal_plain(demo, model):
    ids = ids_of(demo, "The server")
    plain = model.generate(ids, max_new_tokens=30, eos_token_id=None)[0, ids.shape[1]:].tolist()
    eos = plain[9]  # a token greedy emits after a few steps: as eos, generation stops right there
    for name, kwargs in speculations(demo).items():
        for new in (1, 2, 3, 17):
            assert torch.equal(model.generate(ids, max_new_tokens=new, **kwargs), model.generate(ids, max_new_tokens=new)), \
                f"{name}, max_new_tokens={new}"
        stopped = model.generate(ids, max_new_tokens=30, eos_token_id=eos, **kwargs)
        assert torch.equal(stopped, model.generate(ids, max_new_tokens=30, eos_token_id=eos)), name
        assert stopped[0, -1] == eos and stopped.shape[1] - ids.shape[1] <= 10
        later = model.generate(ids, max_new_tokens=30, eos_token_id=eos, min_new_tokens=12, **kwargs)
        assert torch.equal(later, demo["reference"].generate(ids, max_new_tokens=30, eos_token_id=eos,
                                                             min_new_tokens=12, do_sample=False)), name


def test_a_rollback_between_calls_then_speculation_equals_a_fresh_run(demo, model):
    ids = ids_of(demo, TEXT)
    for name, kwargs in speculations(demo).items():
        with model.inference_session(max_length=ids.shape[1] + 80) as session:
            first = model.generate(ids, max_new_tokens=30, session=session, **kwargs)
            keep = ids.shape[1] + 7
            session.rollback(keep)
            again = model.generate(None, max_new_tokens=40, session=session, **kwargs)
        expected = demo["reference"].generate(first[:, :keep], max_new_tokens=40, do_sample=False)
        assert torch.equal(again, expected[:, keep:]), name


def test_a_left_padded_batch_gives_each_row_its_tokens_alone(demo, model):
    prompts = [ids_of(demo, t)[0].tolist() for t in (TEXT, "The server", "Human: Hello.\nAssistant: Hello. Human:")]
    width = max(len(p) for p in prompts)
    pad = demo["tokenizer"].pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    for name, kwargs in speculations(demo).items():
        with model.inference_session(max_length=width + 40, batch_size=3) as session:
            got = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None, session=session, **kwargs)
            if name == "draft":  # prompt lookup speeds a batch up only while every row finds a repeat
                assert session.steps < 40
        for row, prompt in enumerate(prompts):
            alone = demo["reference"].generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
            assert torch.equal(got[row, width - len(prompt):], alone[0]), f"{name}: row {row}"


def test_seeded_sampling_is_reproducible_and_keeps_rows_apart(demo, model):
    ids = ids_of(demo, "The server")
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=40, num_return_sequences=2)
    for name, kwargs in speculations(demo).items():
        runs = []
        for _ in range(2):
            torch.manual_seed(11)
            runs.append(model.generate(ids, **sampling, **kwargs))
        assert torch.equal(runs[0], runs[1]), name
        assert not torch.equal(runs[0][0], runs[0][1]), f"{name}: both rows sampled the same tokens"


def test_beam_search_with_speculation_is_refused_before_anything_is_sent(demo, model):
    with model.inference_session(max_length=64) as session:
        for kwargs in speculations(demo).values():
            with pytest.raises(ValueError, match="beam search"):
                model.generate(ids_of(demo, "The server"), num_beams=2, session=session, **kwargs)
        assert session.steps == 0 and session.position == 0


def test_an_assistant_with_another_vocabulary_is_refused(demo, model):
    other = AutoModelForCausalLM.from_config(demo["draft"].config.__class__(**{**demo["draft"].config.to_dict(),
                                                                              "vocab_size": 100}))
    with pytest.raises(ValueError, match="same tokenizer|vocab_size"):
        model.generate(ids_of(demo, "The server"), assistant_model=other, max_new_tokens=4)


def test_prompt_lookup_after_inputs_embeds_equals_plain(demo, model):
    ids = ids_of(demo, TEXT)
    embeds = model.get_input_embeddings()(ids)
    plain = model.generate(inputs_embeds=embeds, max_new_tokens=40)
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=40, prompt_lookup_num_tokens=6), plain)
    with pytest.raises(ValueError, match="inputs_embeds"):
        model.generate(inputs_embeds=embeds, max_new_tokens=4, assistant_model=demo["draft"])


def test_corolla_generate_prints_the_same_text_with_the_demo_draft_and_with_prompt_lookup(demo, model, capsys):
    """`corolla generate`'s parser and command, in process (test_cli runs the command as a process)."""
    def generate(*extra: str) -> str:
        args = build_parser().parse_args(["generate", demo["path"], "--initial-peers", *demo["peers"],
                                          "--max-new-tokens", "40", "The server", *extra])
        capsys.readouterr()
        assert args.func(args) == 0
        return capsys.readouterr().out

    plain = generate()
    assert plain.strip() and generate("--assistant-model", "demo") == plain == generate("--prompt-lookup", "5")


# ---------------------------------------------------------------------- other families
FAMILIES = ["mistral-window8", "bloom", "falcon-7b-style", "mixtral"]  # llama: the demo model above


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, shared_swarms):
    """(distributed model, local HF model) of a tiny random checkpoint on two servers (0:2, 2:4): test_families'
    swarm of that family (conftest's SharedSwarms)."""
    swarm = shared_swarms.for_fixture(request, start_family_swarm(request.param))
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers,
                                                            torch_dtype=torch.float32)
    try:
        yield model, AutoModelForCausalLM.from_pretrained(swarm.model_path, dtype=torch.float32).eval()
    finally:
        model.shutdown()


def test_every_family_decodes_speculatively_exactly_as_hf_greedy(family):
    model, reference = family
    prompt = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([prompt, prompt[:, :6]], dim=1)  # a repeat for prompt lookup to find
    expected = reference.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=None)
    itself = dict(assistant_model=reference, num_assistant_tokens=5, assistant_confidence_threshold=0.0)  # HF's 0.4
    runs = (  # HF's confidence threshold 0.4 would end drafts early: random weights are unsure
        dict(itself, passes_in_flight=1),
        dict(itself, passes_in_flight=3),  # pipelined: every pass kept, none cancelled
        dict(prompt_lookup_num_tokens=4),  # "auto": mostly rejected, the most cancellations
    )
    for kwargs in runs:
        with model.inference_session(max_length=prompt.shape[1] + 60) as session:
            out = model.generate(prompt, max_new_tokens=60, eos_token_id=None, session=session, **kwargs)
        assert torch.equal(out, expected), f"{sorted(kwargs)} differs from HF greedy"
        assert session.position == out.shape[1] - 1
        if kwargs.get("passes_in_flight") == 1:
            assert session.steps == 10  # the model drafting for itself: 6 tokens per round trip, 60 = 10 * 6
        elif "assistant_model" in kwargs:  # every pass kept (whether one was still unanswered when the next was
            assert session.cancelled_steps == 0  # sent depends on drafting vs loopback: the slow-server tests check it)


# ---------------------------------------------------------------------- failover
class KillAfter(Recorder):
    """A streamer that calls `action()` once, right after its `n`-th put."""

    def __init__(self, n: int, action):
        super().__init__()
        self.n, self.action = n, action

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if len(self.puts) == self.n:
            self.action()


@pytest.mark.parametrize("drafter", ["itself", pytest.param("lookup", marks=pytest.mark.slow)])  # failover matrix
def test_killing_a_server_mid_speculation_with_a_replica_keeps_the_greedy_output(tiny_llama_path, tmp_path, drafter):
    """kill -9 of the tail server right after the 10th token: the session replays the inputs the rolled-back
    positions left (not the rejected drafts) into the replica, and the output is plain greedy's."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 11, 22, 33, 44, 11, 22, 33]])
    expected = reference.generate(prompt, max_new_tokens=40, do_sample=False)
    kwargs = (dict(assistant_model=reference, num_assistant_tokens=4, assistant_confidence_threshold=0.0)
              if drafter == "itself" else dict(prompt_lookup_num_tokens=4))
    servers = {"head": ["--blocks", "0:2"], "tail": ["--blocks", "2:4", "--throughput", "1000"],
               "replica": ["--blocks", "2:4", "--throughput", "10"]}
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}) as local:
        swarm = start_named_servers(local, tiny_llama_path, servers)
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama_path, initial_peers=swarm.peers)
        try:
            killer = KillAfter(11, lambda: local.kill(swarm.procs["tail"], signal.SIGKILL))  # the prompt, 10 tokens
            with model.inference_session(max_length=64) as session:
                out = model.generate(prompt, max_new_tokens=40, session=session, streamer=killer, **kwargs)
                steps = session.steps - session.cancelled_steps  # passes whose answers were used
        finally:
            model.shutdown()
    assert torch.equal(out, expected)
    assert not swarm.procs["tail"].alive()
    assert steps < 40



@pytest.mark.slow  # ~20 s: three servers of their own
def test_killing_the_head_server_with_passes_in_flight_keeps_the_greedy_output(tiny_llama_path, tmp_path):
    """kill -9 of the first server (the one every pass enters by) with four passes in flight: the passes not
    answered are redone on a route through its replica, and the output is plain greedy's."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 11, 22, 33, 44, 11, 22, 33]])
    expected = reference.generate(prompt, max_new_tokens=40, do_sample=False)
    kwargs = dict(assistant_model=reference, num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                  passes_in_flight=4)
    servers = {"head": ["--blocks", "0:2", "--throughput", "1000"], "replica": ["--blocks", "0:2", "--throughput", "10"],
               "tail": ["--blocks", "2:4", "--inject-fault", "slow"]}  # 0.1 s a step: the passes stay in flight
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}) as local:
        swarm = start_named_servers(local, tiny_llama_path, servers)
        swarm.procs["tail"].popen.send_signal(signal.SIGUSR1)
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama_path, initial_peers=swarm.peers)
        try:
            killer = KillAfter(11, lambda: local.kill(swarm.procs["head"], signal.SIGKILL))
            with model.inference_session(max_length=64) as session:
                out = model.generate(prompt, max_new_tokens=40, session=session, streamer=killer, **kwargs)
                assert session.most_in_flight >= 3
                assert swarm.procs["head"].peer_id not in [s.peer_id for s in session.route]
        finally:
            model.shutdown()
    assert torch.equal(out, expected)
    assert not swarm.procs["head"].alive()
