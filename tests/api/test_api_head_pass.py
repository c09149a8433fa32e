"""The engine's shared head pass over the demo model's real LM head and embeddings: a row that breaks the batch
fails alone, and every other row gets exactly what it would have got alone (greedy and seeded sampling)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from corolla.api.head_pass import HeadPass
from corolla.api.metrics import ApiMetrics
from corolla.api.sampling import SamplingParams, make_generator
from corolla.api.stream import GenerationStream, StreamEvent
from corolla.cli.demo_cmd import demo_model_path


class Head:
    """The client model's head surface (`lm_logits`: final norm + LM head, `embed`) over a local HF model; `pad`
    extra logit columns stand for a checkpoint whose head is wider than its embedding table."""

    def __init__(self, hf: LlamaForCausalLM, pad: int = 0):
        self.hf, self.pad = hf, pad

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.hf.lm_head(self.hf.model.norm(hidden))  # (B, T, V)
        if self.pad:
            out = torch.cat([out, torch.full((*out.shape[:-1], self.pad), 1e4)], dim=-1)  # padding that would win
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(input_ids)


@pytest.fixture(scope="module")
def hf():
    return LlamaForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


def model_of(hf: LlamaForCausalLM, pad: int = 0) -> SimpleNamespace:
    head = Head(hf, pad)
    return SimpleNamespace(lm_logits=head.lm_logits, embed=head.embed, config=hf.config, dtype=torch.float32,
                           device=torch.device("cpu"), get_input_embeddings=hf.get_input_embeddings)


def stream(tokenizer, vocab: int, index: int = 0, **settings) -> GenerationStream:
    params = SamplingParams(max_tokens=50, **settings)
    return GenerationStream([1, 300, 301], params, tokenizer, vocab, make_generator(params.seed, index))


HONEST = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=1.2, top_p=0.9, seed=11),
          dict(temperature=0.0, logprobs=3)]


def test_a_row_that_breaks_the_shared_pass_fails_alone_and_the_others_sample_as_alone(hf, tokenizer):
    head_pass = HeadPass(model_of(hf), ApiMetrics())
    vocab = head_pass.vocab_size
    hidden = torch.randn(5, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))  # (R, H)
    # what each honest row samples over 6 steps when it is alone in its batch
    alone = []
    for i, settings in enumerate(HONEST):
        s = stream(tokenizer, vocab, **settings)
        alone.append([head_pass([s], hidden[i : i + 1])[0][0].token_ids for _ in range(6)])
    # the same rows with hostile ones among them: at step 0 a top_k past int64 (it cannot even become a tensor),
    # at step 3 logprobs given as text (they fail after every row has drawn its random number: the draws are rewound)
    rows = [stream(tokenizer, vocab, **settings) for settings in HONEST]
    hostile = {0: stream(tokenizer, vocab, temperature=1.0, top_k=2**63),
               3: stream(tokenizer, vocab, temperature=1.0, seed=5, logprobs="3")}
    together: list[list] = [[] for _ in HONEST]
    for step in range(6):
        batch, states = list(rows), list(hidden[:4])
        if step in hostile:
            batch.insert(2, hostile[step])
            states.insert(2, hidden[4])
        results = head_pass(batch, torch.stack(states))
        if step in hostile:
            event, embed = results.pop(2)
            assert isinstance(event, BaseException) and embed is None
        for i, (event, embed) in enumerate(results):
            assert isinstance(event, StreamEvent) and embed is not None and embed.shape == (1, 1, hf.config.hidden_size)
            together[i].append(event.token_ids)
    assert together == alone
    assert len({t[0] for t in together[1]}) > 1  # the seeded row does sample


def test_a_stream_whose_text_side_fails_ends_alone(hf, tokenizer):
    head_pass = HeadPass(model_of(hf), ApiMetrics())
    done = stream(tokenizer, head_pass.vocab_size, temperature=0.0)
    done.finish_reason = "stop"  # accept() on a finished stream raises
    honest = stream(tokenizer, head_pass.vocab_size, temperature=0.0)
    hidden = torch.randn(2, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    (bad, bad_embed), (good, good_embed) = head_pass([done, honest], hidden)
    assert isinstance(bad, RuntimeError) and bad_embed is None
    assert isinstance(good, StreamEvent) and good_embed is not None


def test_a_head_wider_than_the_embeddings_never_picks_the_padding(hf, tokenizer):
    head_pass = HeadPass(model_of(hf, pad=64), ApiMetrics())
    rows = hf.get_input_embeddings().num_embeddings
    assert (head_pass.vocab_size, head_pass.token_limit) == (rows + 64, rows)
    streams = [stream(tokenizer, head_pass.vocab_size, temperature=0.0),
               stream(tokenizer, head_pass.vocab_size, temperature=1.5, seed=3)]
    hidden = torch.randn(2, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for _ in range(5):
        for event, embed in head_pass(streams, hidden):
            assert isinstance(event, StreamEvent) and event.token_ids[0] < rows and embed is not None
