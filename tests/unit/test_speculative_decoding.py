"""Speculative decoding without a swarm: the draft rules, the acceptance rules and the decoding loop, with a local HF
model as the target (a verifier that recomputes the whole sequence each step) and HF's `generate` as the oracle."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import LogitsProcessorList, MinLengthLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from corolla.client.decoding import settings
from corolla.client.decoding.assistant_drafter import AssistantDrafter
from corolla.client.decoding.prompt_lookup import PromptLookupDrafter, lookup
from corolla.client.decoding.speculative import Draft, choose_tokens, leading_run, speculative_decode

VOCAB = 64
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=0)
PROMPT = torch.tensor([[1, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
NO_EOS = torch.tensor([], dtype=torch.long)


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def small() -> LlamaForCausalLM:
    return tiny_llama(1, num_hidden_layers=1)


class LocalVerifier:
    """The target's logits for sequence + draft, recomputed from scratch; counts steps and positions."""

    def __init__(self, model):
        self.model, self.steps, self.drafted = model, 0, 0

    @torch.no_grad()
    def verify(self, sequence, draft):
        self.steps += 1
        self.drafted += draft.shape[1]
        return self.model(torch.cat([sequence, draft], dim=1)).logits[:, -(draft.shape[1] + 1):].float()

    def forget_rejected(self, sequence):
        pass


def decode(target, drafter, prompt, new, *, do_sample=False, processors=None, eos=(), pad=0, streamer=None):
    verifier = LocalVerifier(target)
    criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + new)])
    if eos:
        criteria.append(EosTokenCriteria(torch.tensor(list(eos))))
    out = speculative_decode(verifier, drafter, prompt, None, do_sample=do_sample,
                             processors=processors or LogitsProcessorList(), criteria=criteria,
                             max_length=prompt.shape[1] + new, pad=pad, has_eos=bool(eos), streamer=streamer)
    return out, verifier


# ---------------------------------------------------------------------- the draft rules
def test_lookup_continues_the_first_occurrence_of_the_longest_matching_ngram():
    tokens = torch.tensor([4, 5, 6, 9, 5, 6, 7, 8, 3, 5, 6])
    assert lookup(tokens, 3, 2, NO_EOS).tolist() == [9, 5, 6]  # (5, 6) first at 1: continues with 9, 5, 6
    assert lookup(tokens, 10, 2, NO_EOS).tolist() == [9, 5, 6, 7, 8, 3, 5, 6]  # up to the end of the context


def test_lookup_falls_back_to_shorter_ngrams_and_finds_nothing_without_a_repeat():
    assert lookup(torch.tensor([1, 2, 3, 4, 2, 9, 3]), 2, 2, NO_EOS).tolist() == [4, 2]  # (9, 3) never seen: (3,)
    assert lookup(torch.tensor([1, 2, 3, 4]), 5, 3, NO_EOS).tolist() == []
    assert lookup(torch.tensor([7]), 5, 2, NO_EOS).tolist() == []


def test_lookup_cuts_the_draft_before_its_first_eos():
    tokens = torch.tensor([5, 6, 8, 2, 9, 5, 6])
    assert lookup(tokens, 4, 2, torch.tensor([2])).tolist() == [8]


def test_prompt_lookup_drafter_searches_real_tokens_only_and_drafts_fill_for_finished_rows():
    sequence = torch.tensor([[0, 0, 4, 5, 4], [4, 5, 6, 4, 5], [1, 2, 3, 1, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    drafter = PromptLookupDrafter(3, 2, [], LogitsProcessorList(), VOCAB)
    draft = drafter.propose(sequence, mask, torch.tensor([False, False, True]), fill=0, limit=10)
    assert draft.tokens.tolist() == [[5, 4, 0], [6, 4, 5], [0, 0, 0]]
    assert draft.lengths.tolist() == [2, 3, 3]
    assert drafter.propose(sequence, mask, torch.zeros(3, dtype=torch.bool), 0, limit=1).tokens.shape == (3, 1)


def test_prompt_lookup_drafts_stop_at_a_token_the_processors_forbid():
    sequence = torch.tensor([[5, 6, 2, 7, 5, 6]])  # the draft would be [2, 7] but eos (2) is forbidden below length 9
    forbid = LogitsProcessorList([MinLengthLogitsProcessor(9, torch.tensor([2]))])
    draft = PromptLookupDrafter(2, 2, [], forbid, VOCAB).propose(sequence, None, torch.tensor([False]), 0, 5)
    assert draft.lengths.tolist() == [0]


# ---------------------------------------------------------------------- the acceptance rules
def test_leading_run_counts_agreement_from_the_start_within_each_rows_draft():
    agree = torch.tensor([[True, True, False, True], [True, True, True, True], [False, True, True, True]])
    assert leading_run(agree, torch.tensor([4, 3, 4]), torch.tensor([False, False, False])).tolist() == [2, 3, 0]
    assert leading_run(agree, torch.tensor([4, 3, 4]), torch.tensor([False, False, True])).tolist() == [2, 3, 4]


def test_greedy_choice_keeps_the_fewest_rows_run_then_the_targets_own_token():
    scores = torch.full((2, 4, 10), -5.0)
    targets = torch.tensor([[3, 4, 5, 6], [3, 9, 5, 6]])  # the target's argmax after each prefix
    scores.scatter_(2, targets[:, :, None], 5.0)
    draft = Draft(torch.tensor([[3, 4, 7], [3, 4, 5]]), torch.tensor([3, 3]))
    # row 0 keeps 3, 4 (then 7 != 5); row 1 keeps 3 (then 4 != 9): both keep one, then the target's token
    assert choose_tokens(scores, draft, torch.tensor([False, False]), do_sample=False).tolist() == [[3, 4], [3, 9]]
    # row 1 finished: row 0 alone sets the length (row 1's tokens become padding in the loop)
    assert choose_tokens(scores, draft, torch.tensor([False, True]), do_sample=False)[0].tolist() == [3, 4, 5]


def _markov(vocab: int, seed: int, sharpness: float) -> torch.Tensor:
    """A random transition matrix's logits (vocab, vocab): row a = logits of the token after a."""
    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * sharpness


def _transitions(rows: int, steps: int, k: int, target: torch.Tensor, draft: torch.Tensor | None, seed: int) -> torch.Tensor:
    """Counts (V, V) of consecutive token pairs produced by speculative sampling of a Markov chain target, with a
    Markov chain drafter (or, if `draft` is None, a fixed deterministic draft, as prompt lookup's) and `rows` rows
    decoding in lockstep (the batch rule: the fewest kept tokens over the rows)."""
    torch.manual_seed(seed)
    vocab = target.shape[0]
    sequence = torch.zeros(rows, 1, dtype=torch.long)
    free = torch.zeros(rows, dtype=torch.bool)
    while sequence.shape[1] < steps:
        tokens, scores, last = [], [], sequence[:, -1]
        for _ in range(k):
            if draft is None:
                token = (last + 1) % vocab
            else:
                scores.append(draft[last])
                token = torch.multinomial(torch.softmax(draft[last], -1), 1).squeeze(1)
            tokens.append(token)
            last = token
        proposed = torch.stack(tokens, dim=1)  # (rows, k)
        prefix = torch.cat([sequence[:, -1:], proposed], dim=1)  # the token before each verified position
        logits = target[prefix]  # (rows, k + 1, V)
        step = Draft(proposed, torch.full((rows,), k), None if draft is None else torch.stack(scores, dim=1))
        sequence = torch.cat([sequence, choose_tokens(logits, step, free, do_sample=True)], dim=1)
    counts = torch.zeros(vocab, vocab)
    pairs = torch.stack([sequence[:, :-1].flatten(), sequence[:, 1:].flatten()], dim=1)
    counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True)
    return counts


@pytest.mark.parametrize("rows, length", [(1, 8000), (16, 600)])
@pytest.mark.parametrize("with_draft_model", [True, False])
def test_speculative_sampling_keeps_the_targets_distribution(rows, length, with_draft_model):
    """Every emitted token follows the target's conditional distribution, whatever the draft proposes, also when
    rows decode in lockstep (checked on the transition frequencies of a 4-token Markov chain, fixed seed)."""
    vocab = 4
    target = _markov(vocab, 0, 1.5)
    draft = _markov(vocab, 1, 1.5) if with_draft_model else None
    counts = _transitions(rows, length, 3, target, draft, seed=2)
    expected = torch.softmax(target, -1)
    observed = counts / counts.sum(dim=1, keepdim=True)
    # each row of the estimate holds ~2000 pairs here or more: a 4-sigma band around each probability
    sigma = (expected * (1 - expected) / counts.sum(dim=1, keepdim=True)).sqrt()
    assert bool(((observed - expected).abs() <= 4 * sigma + 1e-3).all()), (observed, expected)
    # a draft that disagrees with the target must not leak its own distribution in
    if with_draft_model:
        assert not torch.allclose(torch.softmax(draft, -1), expected, atol=0.05)


def test_seeded_speculative_sampling_is_reproducible():
    target, draft = _markov(6, 3, 2.0), _markov(6, 4, 2.0)
    assert torch.equal(_transitions(2, 300, 4, target, draft, seed=7), _transitions(2, 300, 4, target, draft, seed=7))


# ---------------------------------------------------------------------- the loop against HF
@pytest.mark.parametrize("new", [1, 2, 7, 40])
def test_greedy_with_prompt_lookup_equals_hf_greedy(target, new):
    expected = target.generate(PROMPT, max_new_tokens=new, do_sample=False)
    out, verifier = decode(target, PromptLookupDrafter(4, 2, [], LogitsProcessorList(), VOCAB), PROMPT, new)
    assert torch.equal(out, expected)
    assert verifier.drafted <= 4 * verifier.steps


def test_greedy_with_an_assistant_equals_hf_greedy_and_a_perfect_assistant_verifies_k_plus_one_per_step(target, small):
    expected = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    out, _ = decode(target, AssistantDrafter(small, LogitsProcessorList(), [], False, 5), PROMPT, 40)
    assert torch.equal(out, expected)
    out, verifier = decode(target, AssistantDrafter(target, LogitsProcessorList(), [], False, 5), PROMPT, 40)
    assert torch.equal(out, expected)
    assert verifier.steps == 7  # 6 tokens per step (5 drafted and kept, 1 the target's), 40 = 6 * 6 + 4


def test_greedy_stops_at_eos_inside_a_kept_draft_and_the_streamer_sees_what_plain_decoding_shows(target):
    plain = target.generate(PROMPT, max_new_tokens=40, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    eos = plain[6]  # a token the target emits after a few steps: generation must end right there
    expected = target.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)

    class Recorder:
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.tolist())

    streamer = Recorder()
    out, _ = decode(target, AssistantDrafter(target, LogitsProcessorList(), [eos], False, 8), PROMPT, 40,
                    eos=[eos], streamer=streamer)
    assert torch.equal(out, expected)
    assert streamer.puts == [[t] for t in out[0, PROMPT.shape[1]:].tolist()]  # one column per put, as plain decoding


def test_seeded_sampling_with_an_assistant_equals_hfs_assisted_generation_draw_for_draw(target, small):
    """With no sampling warpers HF's assistant samples from exactly the target's settings, and then our draws are
    HF's, in the same order (HF's assistant applies warpers twice: with temperature / top_k set, its drafts are
    sharper than the target's settings say, and only the distribution can be compared)."""
    config = GenerationConfig(**{**settings.HF_DEFAULTS, "do_sample": True, "top_k": 0})
    processors = settings.logits_processors(config, PROMPT.shape[1], [], None)
    for seed in range(3):
        torch.manual_seed(seed)
        expected = target.generate(PROMPT, assistant_model=small, max_new_tokens=30, do_sample=True, top_k=0)
        torch.manual_seed(seed)
        drafter = AssistantDrafter(small, processors, [], True, 20, "constant", 0.4)  # HF's defaults
        out, _ = decode(target, drafter, PROMPT, 30, do_sample=True, processors=processors)
        assert torch.equal(out, expected)


def test_the_assistants_cache_rolled_back_drafts_what_a_fresh_assistant_drafts(target, small):
    drafter = AssistantDrafter(small, LogitsProcessorList(), [], False, 4)
    free = torch.tensor([False])
    drafter.propose(PROMPT, None, free, 0, 10)
    changed = torch.cat([PROMPT, torch.tensor([[33, 34]])], dim=1)  # a sequence the draft did not predict
    again = drafter.propose(changed, None, free, 0, 10)
    fresh = AssistantDrafter(small, LogitsProcessorList(), [], False, 4).propose(changed, None, free, 0, 10)
    assert torch.equal(again.tokens, fresh.tokens)
    assert torch.allclose(again.scores, fresh.scores, atol=1e-5)


def test_the_heuristic_schedule_grows_after_a_full_accept_and_shrinks_otherwise(small):
    drafter = AssistantDrafter(small, LogitsProcessorList(), [], False, 3, "heuristic")
    drafter.update(3, 3)
    assert drafter.num_tokens == 5
    drafter.update(1, 5)
    drafter.update(0, 4)
    assert drafter.num_tokens == 3
    constant = AssistantDrafter(small, LogitsProcessorList(), [], False, 3)
    constant.update(3, 3)
    assert constant.num_tokens == 3


# ---------------------------------------------------------------------- settings
def _config(**kwargs) -> GenerationConfig:
    return GenerationConfig(**{**settings.HF_DEFAULTS, **kwargs})


def test_speculation_settings_come_from_the_arguments_then_the_assistants_config_then_hfs_defaults():
    assert settings.speculation(_config(), None, False) is None
    lookup = settings.speculation(_config(prompt_lookup_num_tokens=5), None, False)
    assert (lookup.prompt_lookup, lookup.num_tokens, lookup.max_ngram) == (True, 5, 2)
    assert settings.speculation(_config(), None, True) == settings.Speculation(False, 20, 2, "constant", 0.4)
    own = GenerationConfig(num_assistant_tokens=6, assistant_confidence_threshold=0.0)
    assert settings.speculation(_config(), own, True) == settings.Speculation(False, 6, 2, "constant", 0.0)
    given = settings.speculation(_config(num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic"), own, True)
    assert (given.num_tokens, given.schedule, given.confidence) == (3, "heuristic", 0.0)


@pytest.mark.parametrize("kwargs, has_assistant, message", [
    (dict(prompt_lookup_num_tokens=3, num_beams=2), False, "beam search"),
    (dict(prompt_lookup_num_tokens=3), True, "not both"),
    (dict(prompt_lookup_num_tokens=0), False, ">= 1"),
    (dict(num_assistant_tokens_schedule="sometimes"), True, "schedule"),
    (dict(assistant_confidence_threshold=1.5), True, "threshold"),
])
def test_unsupported_speculation_gets_a_clear_error(kwargs, has_assistant, message):
    with pytest.raises(ValueError, match=message):
        settings.speculation(_config(**kwargs), None, has_assistant)
