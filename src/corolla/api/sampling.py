"""One sampling pass over every active stream's logits, each row with its own settings and random generator.

Per row, in this order (vLLM's and HF's order): repetition penalty (HF's rule, over prompt and completion),
presence and frequency penalties (OpenAI's rule, over the completion), logit bias, then either argmax
(temperature 0) or temperature, top-k, top-p, min-p and one draw. The draw is inverse-CDF sampling with one
uniform number from the row's own `torch.Generator`, so a seeded request samples the same tokens whatever other
streams share its batch. Log-probabilities are those of the model's distribution (log-softmax of the raw logits,
before penalties and temperature), as OpenAI reports them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's rule): dividing by them overflows to inf
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, choice index) pairs so choice i of seed s != choice 0 of seed s + i


@dataclass(frozen=True)
class SamplingParams:
    """How one choice is generated. Values are checked by the request schemas; these are the engine's settings."""

    max_tokens: int  # tokens to generate at most (the stop token included)
    temperature: float = 1.0  # 0 (below GREEDY_BELOW) = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    repetition_penalty: float = 1.0  # HF's: logits of seen tokens divided (positive) or multiplied (negative) by it
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token the completion already holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the completion
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None  # same seed, same prompt, same settings -> same tokens
    stop: tuple[str, ...] = ()  # generation ends before any of these strings (not returned)
    stop_token_ids: tuple[int, ...] = ()  # generation ends at these tokens (the model's eos ids)
    ignore_eos: bool = False  # keep going past stop_token_ids (benchmarks)
    logprobs: int | None = None  # None: no log-probabilities; k >= 0: the sampled token's and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def make_generator(seed: int | None, index: int = 0) -> torch.Generator:
    """The random generator of choice `index` of a request: seeded from (seed, index), or from the OS without a seed."""
    value = random.SystemRandom().getrandbits(63) if seed is None else (seed * _SEED_MIX + index) % (1 << 63)
    return torch.Generator().manual_seed(value)


class RowState:
    """A stream's sampling state: its settings, generator and (only when penalties are on) token statistics."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, generator: torch.Generator):
        self.params = params
        self.generator = generator
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None  # (V,) bool: tokens of prompt and completion (repetition penalty)
        self.counts: torch.Tensor | None = None  # (V,) float32: occurrences in the completion (presence/frequency)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor([i for i in prompt_ids if 0 <= i < vocab_size], dtype=torch.long)] = True
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.bias: torch.Tensor | None = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            for token, value in params.logit_bias:
                self.bias[token] = value

    def uniform(self) -> torch.Tensor:
        """The one random number a sampled token takes (inverse-CDF): a scalar in [0, 1) from the row's generator."""
        return torch.rand((), generator=self.generator)

    def observe(self, token: int) -> None:
        """Record a token the stream generated."""
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1.0


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None  # the token's log-probability, when the row asked for logprobs
    top: list[tuple[int, float]]  # the k most likely (token, log-probability), most likely first


@torch.inference_mode()
def sample_rows(logits: torch.Tensor, rows: list[RowState]) -> list[Sampled]:
    """Pick one token per row of logits (R, V) (any float dtype) with each row's settings; rows are independent."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits (rows={len(rows)}, vocab), got {tuple(logits.shape)}")
    logits = logits.float()
    scores = _penalized(logits, rows)  # (R, V)
    tokens = torch.empty(len(rows), dtype=torch.long)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if greedy:
        tokens[greedy] = scores[greedy].argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        tokens[sampled] = _draw(scores[sampled], [rows[i] for i in sampled])
    return _with_logprobs(logits, tokens, rows)


def _penalized(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """Logits (R, V) after each row's repetition, presence and frequency penalties and logit bias."""
    scores = logits
    rep = [i for i, row in enumerate(rows) if row.seen is not None]
    counted = [i for i, row in enumerate(rows) if row.counts is not None]
    biased = [i for i, row in enumerate(rows) if row.bias is not None]
    if not (rep or counted or biased):
        return scores
    scores = logits.clone()
    if rep:
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep])[:, None]  # (r, 1)
        seen = torch.stack([rows[i].seen for i in rep])  # (r, V) bool
        part = scores[rep]
        penalized = torch.where(part < 0, part * penalty, part / penalty)
        scores[rep] = torch.where(seen, penalized, part)
    if counted:
        counts = torch.stack([rows[i].counts for i in counted])  # (r, V)
        presence = torch.tensor([rows[i].params.presence_penalty for i in counted])[:, None]
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in counted])[:, None]
        scores[counted] = scores[counted] - presence * (counts > 0) - frequency * counts
    if biased:
        scores[biased] = scores[biased] + torch.stack([rows[i].bias for i in biased])
    return scores


def _draw(scores: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """One token per row of scores (r, V): temperature, top-k, top-p, min-p, then inverse-CDF with the row's draw."""
    r, vocab = scores.shape
    temperature = torch.tensor([row.params.temperature for row in rows])[:, None]  # (r, 1)
    ordered, order = torch.sort(scores / temperature, dim=-1, descending=True, stable=True)  # (r, V) each
    rank = torch.arange(vocab)[None, :]  # (1, V)
    top_k = torch.tensor([row.params.top_k if row.params.top_k > 0 else vocab for row in rows])[:, None]
    ordered = ordered.masked_fill(rank >= top_k, -float("inf"))
    probs = torch.softmax(ordered, dim=-1)  # (r, V), descending
    top_p = torch.tensor([row.params.top_p for row in rows])[:, None]
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    keep = (before < top_p) | (rank == 0)
    min_p = torch.tensor([row.params.min_p for row in rows])[:, None]
    keep &= (probs >= min_p * probs[:, :1]) | (rank == 0)
    probs = probs * keep
    cdf = probs.cumsum(dim=-1)  # (r, V)
    draws = torch.stack([row.uniform() for row in rows])[:, None]  # (r, 1) in [0, 1)
    picked = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True).clamp_(max=vocab - 1)  # (r, 1)
    # a zero-probability slot can only be hit through rounding at the very end: step back to the last kept token
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    picked = torch.minimum(picked, last_kept)
    return order.gather(1, picked)[:, 0]


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[RowState]) -> list[Sampled]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    out = [Sampled(int(t), None, []) for t in tokens.tolist()]
    if not wanted:
        return out
    logprobs = torch.log_softmax(logits[wanted], dim=-1)  # (w, V)
    k = min(max(rows[i].params.logprobs or 0 for i in wanted), logits.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        top = [] if top_ids is None else list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist()))
        out[i] = Sampled(out[i].token, float(logprobs[j, out[i].token]), top)
    return out
