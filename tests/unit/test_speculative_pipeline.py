"""Pipelined speculative decoding without a swarm: the loop with several verify passes in flight, against HF's
`generate` (greedy) and the target's distribution (sampling), and the "auto" depth policy.

The verifier here answers each pass from the tokens it was built on (what the servers would compute), however late
the loop reads it, so a pass built on rejected drafts really carries wrong logits: the loop must never use them."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from corolla.client.decoding.assistant_drafter import AssistantDrafter
from corolla.client.decoding.prompt_lookup import PromptLookupDrafter
from corolla.client.decoding.speculative import Draft
from corolla.client.decoding.speculative_pipeline import MAX_PASSES, PipeDepth, PipeStats, pipelined_decode
from test_speculative_decoding import PROMPT, VOCAB, _markov, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


class PipeVerifier:
    """Passes answered from the tokens they were sent after: `logits_of(tokens)` -> (rows, s, V) at every position."""

    def __init__(self, logits_of, latency=0.15):
        self.logits_of, self.latency, self.can_pipeline = logits_of, latency, True
        self.spec = None  # the tokens the "servers" hold after the passes sent
        self.forgotten = 0

    def submit(self, sequence, draft, head):
        self.spec = torch.cat([sequence if head else self.spec, draft], dim=1)
        n = draft.shape[1] + (1 if head else 0)
        return self.spec, n

    @torch.no_grad()
    def logits(self, handle):
        tokens, n = handle
        return self.logits_of(tokens)[:, tokens.shape[1] - n :].float()

    def keep(self, draft):
        pass

    def forget_rejected(self, sequence, handle, draft):
        self.forgotten += 1


def run(verifier, drafter, prompt, new, depth, *, do_sample=False, processors=None, eos=(), streamer=None):
    criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + new)])
    if eos:
        criteria.append(EosTokenCriteria(torch.tensor(list(eos))))
    stats = PipeStats()
    out = pipelined_decode(verifier, drafter, prompt, None, do_sample=do_sample,
                           processors=processors or LogitsProcessorList(), criteria=criteria,
                           max_length=prompt.shape[1] + new, pad=0, has_eos=bool(eos), depth=PipeDepth(depth),
                           streamer=streamer, stats=stats)
    return out, stats


@pytest.mark.parametrize("depth", [2, 4, "auto"])
@pytest.mark.parametrize("drafter", ["lookup", "small", "itself"])
def test_greedy_with_passes_in_flight_equals_hf_greedy(target, depth, drafter):
    expected = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    make = {"lookup": lambda: PromptLookupDrafter(4, 2, [], LogitsProcessorList(), VOCAB),
            "small": lambda: AssistantDrafter(tiny_llama(1, num_hidden_layers=1), LogitsProcessorList(), [], False, 3),
            "itself": lambda: AssistantDrafter(target, LogitsProcessorList(), [], False, 3)}
    out, stats = run(PipeVerifier(lambda t: target(t).logits), make[drafter](), PROMPT, 40, depth)
    assert torch.equal(out, expected)
    if drafter == "itself":  # every draft right: passes stay in flight and none is cancelled
        assert stats.cancelled == 0 and stats.most_in_flight == (depth if depth != "auto" else stats.most_in_flight) > 1
    if drafter == "lookup" and depth == 4:
        assert stats.cancelled > 0  # mostly wrong drafts: the passes built on them were cancelled


def test_a_repetition_penalty_and_eos_inside_a_pass_end_as_plain_decoding(target):
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    plain = target.generate(PROMPT, max_new_tokens=40, do_sample=False, repetition_penalty=1.3)[0, PROMPT.shape[1]:]
    eos = int(plain[9])  # generation must end right at this token, inside some pass
    expected = target.generate(PROMPT, max_new_tokens=40, do_sample=False, repetition_penalty=1.3, eos_token_id=eos,
                               pad_token_id=0)

    class Recorder:
        puts: list = []

        def put(self, value):
            self.puts.append(value.tolist())

    streamer = Recorder()
    drafter = AssistantDrafter(target, processors, [eos], False, 3)
    out, _ = run(PipeVerifier(lambda t: target(t).logits), drafter, PROMPT, 40, 4, processors=processors, eos=[eos],
                 streamer=streamer)
    assert torch.equal(out, expected)
    assert streamer.puts == [[t] for t in out[0, PROMPT.shape[1]:].tolist()]  # one column per put, as plain


class MarkovDrafter:
    """Drafts k tokens from a Markov chain's logits (vocab, vocab), with their scores (speculative sampling)."""

    def __init__(self, logits, k):
        self.logits, self.k = logits, k

    def propose(self, sequence, mask, free, fill, limit):
        tokens, scores, last = [], [], sequence[:, -1]
        for _ in range(min(self.k, limit)):
            scores.append(self.logits[last])
            last = torch.multinomial(torch.softmax(self.logits[last], -1), 1).squeeze(1)
            tokens.append(last)
        if not tokens:
            return Draft.empty(sequence.shape[0])
        return Draft(torch.stack(tokens, 1), torch.full((sequence.shape[0],), len(tokens)), torch.stack(scores, 1))

    def update(self, accepted, drafted):
        pass


def test_pipelined_speculative_sampling_keeps_the_targets_distribution():
    """The transition frequencies of a 4-token Markov chain target, sampled with 3 passes in flight of a different
    chain's drafts, match the target's within 4 sigma (fixed seed)."""
    vocab = 4
    target, draft = _markov(vocab, 0, 1.5), _markov(vocab, 1, 1.5)
    torch.manual_seed(5)
    sequence, stats = run(PipeVerifier(lambda t: target[t]), MarkovDrafter(draft, 3), torch.zeros(1, 1, dtype=torch.long),
                          6000, 3, do_sample=True)
    assert stats.cancelled > 0 and stats.most_in_flight == 3
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((sequence[0, :-1], sequence[0, 1:]), torch.ones(sequence.shape[1] - 1), accumulate=True)
    expected = torch.softmax(target, -1)
    observed = counts / counts.sum(dim=1, keepdim=True)
    sigma = (expected * (1 - expected) / counts.sum(dim=1, keepdim=True)).sqrt()
    assert bool(((observed - expected).abs() <= 4 * sigma + 1e-3).all()), (observed, expected)
    assert not torch.allclose(torch.softmax(draft, -1), expected, atol=0.05)


def test_auto_depth_goes_deep_over_a_wan_when_drafts_are_kept_and_stays_sequential_when_they_are_not():
    depth = PipeDepth("auto")
    assert depth.passes(None) == 2  # nothing measured: one pass behind the head (the prior: half kept whole)
    depth.draft_times.extend([0.005] * 4)
    for _ in range(20):
        depth.record(True)
    assert depth.passes(0.15) == MAX_PASSES  # 150 ms round trips, 5 ms to draft, drafts kept: as deep as allowed
    assert depth.passes(0.01) == 3  # loopback: two more passes are drafted during one round trip
    wrong = PipeDepth("auto")
    wrong.draft_times.extend([0.005] * 4)
    for _ in range(20):
        wrong.record(False)
    assert wrong.passes(0.15) == 1  # drafts mostly rejected: sequential
    assert PipeDepth(3).passes(0.15) == 3


@pytest.mark.parametrize("bad", [0, -1, "deep", 1.5, True])
def test_a_bad_passes_in_flight_setting_is_refused(bad):
    with pytest.raises(ValueError, match="passes_in_flight"):
        PipeDepth(bad)


def test_the_cli_takes_passes_in_flight_as_a_number_or_auto(capsys):
    from corolla.cli.generate_cmd import sampling_kwargs
    from corolla.cli.main import build_parser

    parser = build_parser()
    for text, value in (("3", 3), ("auto", "auto")):
        args = parser.parse_args(["generate", "model", "--initial-peers", "p", "--prompt-lookup", "4",
                                  "--passes-in-flight", text, "hi"])
        assert sampling_kwargs(args)["passes_in_flight"] == value
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "model", "--initial-peers", "p", "--passes-in-flight", bad, "hi"])
        assert "expected 'auto' or an integer >= 1" in capsys.readouterr().err
