"""Model types the generic backend serves, through real swarms, exact against the local HF model.

Each type gets its own 2-server swarm (blocks 0:2 and 2:4 of a 4-layer checkpoint written here by transformers'
``save_pretrained``, weights redrawn large as tests/models does), all on one DHT peer and started together once for
the module, so the whole module pays one start-up. Every type: logits within 1e-4, 20 greedy tokens equal to HF
``generate``, a two-turn session equal to a fresh run. Sliding-window types (window 4) run far past their window,
on ring caches. One type each also checks: a shallow rollback, two sessions decoding at different lengths at once,
a padded batch (ragged decode), beam search, a training gradient, a LoRA adapter (against peft), an int8 server
(its own DHT prefix), and failover: a gemma3_text replica of blocks 0:2 takes over a session when the preferred
server is killed mid-generation (the last test).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import SERVER_ARGS, TestSwarm
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.cli.local_swarm import LocalSwarm

VOCAB = 128
TINY: dict[str, object] = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, num_hidden_layers=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 4
ALTERNATING = ["sliding_attention", "full_attention"] * 2
# model type -> config kwargs on top of TINY
TYPES: dict[str, dict[str, object]] = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    # untied: a tied random Gemma repeats its last token (the scaled embedding dominates the residual stream)
    "gemma2": dict(sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=False),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=16,
                        final_logit_softcapping=30.0, tie_word_embeddings=False),
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=4.0, logits_scaling=2.5, residual_multiplier=0.6, attention_multiplier=0.2,
                    tie_word_embeddings=True),
    "cohere2": dict(sliding_window=WINDOW, layer_types=ALTERNATING, logit_scale=0.5),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=ALTERNATING),
}
SLIDING = ("gemma2", "gemma3_text", "cohere2", "gpt_oss")
ZERO_CENTERED_NORMS = ("gemma2", "gemma3_text")  # norms scale by 1 + weight
LORA_TYPE, LORA_TARGETS = "cohere2", ["q_proj", "v_proj", "o_proj", "down_proj"]
QUANT_TYPE = "olmo2"  # also served whole by an int8 server under its own DHT prefix
FAILOVER_TYPE = "gemma3_text"  # its 0:2 server is preferred by routes and killed by the last test; a replica takes over
# no throughput or bandwidth measurement: 18 servers start at once on a busy machine
FAST_START = ["--throughput", "100", "--network-bandwidth", "1000"]


def write_checkpoint(directory: Path, model_type: str) -> Path:
    """A tiny random checkpoint of ``model_type``: weights N(0, 0.2) (HF's init makes greedy output repeat one or
    two tokens; measured: 7-19 distinct tokens in 20 for every type at 0.2), norm weights N(identity, 0.1)."""
    config = AutoConfig.for_model(model_type, **{**TINY, **TYPES[model_type]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = name.endswith(("norm.weight", "layernorm.weight"))
            centre = 1.0 if is_norm and model_type not in ZERO_CENTERED_NORMS else 0.0
            param.normal_(centre, 0.1 if is_norm else 0.2)
    model.save_pretrained(directory)
    return directory


def save_random_lora(base: Path, directory: Path) -> None:
    """A peft LoRA adapter of ``base`` with random nonzero weights (peft zeroes lora_B)."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory)


class GenericSwarms:
    """One DHT peer; per model type a checkpoint and two servers; clients and HF references made on first use."""

    def __init__(self, local: LocalSwarm, paths: dict[str, str], adapter: str) -> None:
        self.local, self.paths, self.adapter = local, paths, adapter
        self.peers: list[str] = []
        self.peer_ids: dict[str, str] = {}
        self.procs: dict[str, object] = {}
        self._clients: dict[tuple[object, ...], AutoDistributedModelForCausalLM] = {}
        self._references: dict[str, torch.nn.Module] = {}

    def start(self) -> None:
        self.peers = self.local.start_dht()
        procs = {}
        for model_type, path in self.paths.items():
            extra = ["--adapters", self.adapter] if model_type == LORA_TYPE else []
            for blocks in ("0:2", "2:4"):
                speed = ["--throughput", "1000"] if (model_type, blocks) == (FAILOVER_TYPE, "0:2") else []
                procs[f"{model_type}-{blocks}"] = self.local.start_server(
                    path, ["--blocks", blocks, *extra, *FAST_START, *speed, *SERVER_ARGS], name=f"{model_type}-{blocks}",
                    wait=False)
        procs["replica"] = self.local.start_server(
            self.paths[FAILOVER_TYPE], ["--blocks", "0:2", "--throughput", "10", "--network-bandwidth", "1000",
                                        *SERVER_ARGS], name="replica", wait=False)
        procs["int8"] = self.local.start_server(
            self.paths[QUANT_TYPE], ["--blocks", "0:4", "--quant", "int8", "--dht-prefix", "int8", *FAST_START,
                                     *SERVER_ARGS], name="int8", wait=False)
        for proc in procs.values():
            self.local.wait_ready(proc, 600)
        self.procs = procs
        self.peer_ids = {name: proc.peer_id for name, proc in procs.items()}

    def client(self, model_type: str, prefix: str | None = None, **config: object) -> AutoDistributedModelForCausalLM:
        key = (model_type, prefix, *sorted(config.items()))
        if key not in self._clients:
            self._clients[key] = AutoDistributedModelForCausalLM.from_pretrained(
                self.paths[model_type], initial_peers=self.peers, dht_prefix=prefix, torch_dtype=torch.float32,
                client_config=ClientConfig(**config) if config else None)
        return self._clients[key]

    def reference(self, model_type: str) -> torch.nn.Module:
        if model_type not in self._references:
            self._references[model_type] = AutoModelForCausalLM.from_pretrained(
                self.paths[model_type], dtype=torch.float32).eval()
        return self._references[model_type]

    def close(self) -> None:
        for model in self._clients.values():
            model.shutdown()


@pytest.fixture(scope="module")
def swarms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenericSwarms]:
    root = tmp_path_factory.mktemp("generic")
    paths = {model_type: str(write_checkpoint(root / model_type, model_type)) for model_type in TYPES}
    adapter = root / "lora"
    save_random_lora(Path(paths[LORA_TYPE]), adapter)
    log_path = tmp_path_factory.mktemp("logs") / "generic-swarm.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(root / "cache")}) as local:
        swarms = GenericSwarms(local, paths, str(adapter))
        swarms.start()
        try:
            yield swarms
        finally:
            swarms.close()


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def hf_generate(reference: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """HF greedy generation; the explicit mask stops HF from taking a generated pad token (0) for padding."""
    return reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_swarm_logits_match_the_local_model(swarms: GenericSwarms, model_type: str) -> None:
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = swarms.reference(model_type)(ids).logits
    torch.testing.assert_close(swarms.client(model_type)(ids).logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_twenty_greedy_tokens_equal_hf_generate(swarms: GenericSwarms, model_type: str) -> None:
    ids = prompt(7)
    expected = hf_generate(swarms.reference(model_type), ids, max_new_tokens=20)
    assert len(set(expected[0, 7:].tolist())) > 2, "degenerate checkpoint: greedy output barely varies"
    assert torch.equal(swarms.client(model_type).generate(ids, max_new_tokens=20, eos_token_id=None), expected)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_a_two_turn_session_equals_a_fresh_run(swarms: GenericSwarms, model_type: str) -> None:
    model, first, second = swarms.client(model_type), prompt(4, seed=2), prompt(2, seed=3)
    with model.inference_session(max_length=64) as session:
        turn1 = model.generate(first, max_new_tokens=6, session=session, eos_token_id=None)
        turn2 = model.generate(second, max_new_tokens=6, session=session, eos_token_id=None)
    # each call returns its own ids plus the new tokens, like HF; the session holds both turns
    assert torch.equal(turn1[:, :4], first) and torch.equal(turn2[:, :2], second)
    fresh = hf_generate(swarms.reference(model_type), torch.cat([turn1, second], dim=1), max_new_tokens=6)
    assert torch.equal(turn2, fresh[:, turn1.shape[1]:])


@pytest.mark.parametrize("model_type", SLIDING)
def test_sliding_window_models_stay_exact_far_past_their_window(swarms: GenericSwarms, model_type: str) -> None:
    """A 30-token prompt and 30 new tokens: 15 windows; the sliding layers' caches are rings of 2 x 4 + 1 slots."""
    ids = prompt(30, seed=4)
    expected = hf_generate(swarms.reference(model_type), ids, max_new_tokens=30)
    assert torch.equal(swarms.client(model_type).generate(ids, max_new_tokens=30, eos_token_id=None), expected)


def test_a_shallow_rollback_on_ring_caches_equals_a_fresh_run(swarms: GenericSwarms) -> None:
    model, reference = swarms.client("gemma3_text"), swarms.reference("gemma3_text")
    ids = prompt(20, seed=5)
    with model.inference_session(max_length=64) as session:
        first = model.generate(ids, max_new_tokens=10, session=session, eos_token_id=None)
        session.rollback(26)  # 4 tokens back, within what a ring of 2 x window keeps
        again = model.generate(None, max_new_tokens=8, session=session, eos_token_id=None)
    # generate(None, session=...) has no ids of its own: it returns only the new tokens
    assert torch.equal(again, hf_generate(reference, first[:, :26], max_new_tokens=8)[:, 26:])


def test_two_sessions_at_different_lengths_decoding_at_once_each_equal_hf(swarms: GenericSwarms) -> None:
    model, reference = swarms.client("qwen3_moe"), swarms.reference("qwen3_moe")
    prompts = [prompt(3, seed=6), prompt(17, seed=7)]
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        results[i] = model.generate(prompts[i], max_new_tokens=16, eos_token_id=None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for i, ids in enumerate(prompts):
        assert torch.equal(results[i], hf_generate(reference, ids, max_new_tokens=16))


def test_a_left_padded_batch_equals_each_prompt_alone(swarms: GenericSwarms) -> None:
    """Rows at different lengths decode together (ragged steps), the sliding layers on rings."""
    model, reference = swarms.client("gpt_oss"), swarms.reference("gpt_oss")
    prompts = [prompt(3, seed=8)[0].tolist(), prompt(12, seed=9)[0].tolist(), prompt(7, seed=10)[0].tolist()]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    got = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=12, eos_token_id=None)
    logits = model(ids, attention_mask=mask).logits
    for row, tokens in enumerate(prompts):
        alone = hf_generate(reference, torch.tensor([tokens]), max_new_tokens=12)
        assert torch.equal(got[row, width - len(tokens):], alone[0])
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(logits[row, mask[row].bool()], expected, atol=1e-4, rtol=0)


def test_beam_search_equals_hf(swarms: GenericSwarms) -> None:
    model, reference = swarms.client("gemma2"), swarms.reference("gemma2")
    ids = prompt(6, seed=11)
    kwargs = dict(max_new_tokens=10, num_beams=3, eos_token_id=None, pad_token_id=0)
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_gradient_wrt_inputs_embeds_equals_local_autograd(swarms: GenericSwarms) -> None:
    model, reference = swarms.client("granite"), swarms.reference("granite").requires_grad_(False)
    ids = prompt(9, seed=12)
    weights = torch.randn(1, 9, VOCAB, generator=torch.Generator().manual_seed(13))
    grads = []
    # HF multiplies inputs_embeds by embedding_multiplier itself; our client's embed() already did
    scale = float(reference.config.embedding_multiplier)
    for run in (lambda x: model(inputs_embeds=x).logits, lambda x: reference(inputs_embeds=x / scale).logits):
        x = model.head.embed(ids).detach().clone().requires_grad_(True)
        (run(x) * weights).sum().backward()
        grads.append(x.grad)
    assert grads[1].abs().max() > 1e-3
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


def test_a_lora_adapter_on_generic_servers_equals_peft(swarms: GenericSwarms) -> None:
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(swarms.reference(LORA_TYPE), swarms.adapter).eval()
    model = swarms.client(LORA_TYPE, active_adapter=swarms.adapter)
    ids = prompt(11, seed=14)
    with torch.no_grad():
        expected = peft_model(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    assert (expected - base).abs().max() > 1e-2, "the adapter should change the logits"
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=0)


def test_an_int8_generic_server_stays_close_to_the_float_model(swarms: GenericSwarms) -> None:
    import torch.nn.functional as F

    model = swarms.client(QUANT_TYPE, "int8")
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected = swarms.reference(QUANT_TYPE)(ids).logits
    got = model(ids).logits
    assert 1 - F.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item() < 1e-3
    assert not torch.equal(got, expected)  # really quantized


class _KillAfter:
    """A streamer that SIGKILLs a server right after the ``n``-th generated token."""

    def __init__(self, n: int, kill) -> None:
        self.n, self.kill, self.seen = n, kill, -1

    def put(self, value) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.kill()

    def end(self) -> None:
        pass


def test_killing_a_server_mid_generation_replays_the_session_onto_the_replica(swarms: GenericSwarms) -> None:
    """Runs last in this module (it consumes the preferred server). The replica rebuilds the session's ring caches
    from the replayed history, a prefill chunk longer than the ring."""
    model, reference = swarms.client(FAILOVER_TYPE), swarms.reference(FAILOVER_TYPE)
    ids = prompt(20, seed=16)
    victim = swarms.procs[f"{FAILOVER_TYPE}-0:2"]
    with model.inference_session(max_length=64) as session:
        out = model.generate(ids, max_new_tokens=20, session=session, eos_token_id=None,
                             streamer=_KillAfter(8, lambda: swarms.local.kill(victim)))
        ended_on = [s.peer_id for s in session.route]
    assert swarms.peer_ids["replica"] in ended_on and swarms.peer_ids[f"{FAILOVER_TYPE}-0:2"] not in ended_on
    assert torch.equal(out, hf_generate(reference, ids, max_new_tokens=20))
