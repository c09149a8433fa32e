"""Beam search with Hugging Face's scoring, step for step, over any source of next-token logits.

Per prompt b there are `num_beams` running hypotheses (rows b * num_beams + j of the session). Each step:

    log_probs = processors(log_softmax(logits))            (B * nb, V)
    scores    = log_probs + running_scores                 (B, nb * V)   accumulated log-probability
    top K = max(2, 1 + n_eos) * nb candidates              (B, K)        K > nb: enough survive when some end
    ended     = stopping criteria (eos, max_length, stop strings) on each candidate
    running  <- best nb candidates that did not end        (their beam of origin = next step's hypo ids)
    finished <- best nb of (finished, candidates among the top nb that ended), scored / gen_len ** length_penalty

and the search stops when no running beam can beat the worst finished one (HF's early-stopping heuristic, with
`early_stopping` True / False / "never"), when every candidate ended, or at max_length. The returned sequences
are the best `num_return_sequences` finished hypotheses per prompt, as HF's `generate` returns them.

The logits come from `logits_fn(sequences, hypo_ids)`: given the running sequences (B * nb, cur_len) and, after
the first step, which previous row each row continues, it returns the last position's logits (B * nb, V). The
client feeds it from an inference session that reorders the servers' caches by those ids; a test feeds it from
a local HF model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

LogitsFn = Callable[[torch.Tensor, "list[int] | None"], torch.Tensor]
_NEG = -1.0e9  # HF's "impossible" score


@dataclass(frozen=True)
class BeamSettings:
    num_beams: int
    max_length: int  # total tokens, prompt included
    length_penalty: float = 1.0  # finished scores are divided by generated_length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in HF
    num_return_sequences: int = 1
    do_sample: bool = False  # beam sampling: draw the K candidates instead of taking the top K
    n_eos: int = 0  # number of eos token ids
    fill_token: int = -1  # what fills returned sequences past their end


@dataclass(frozen=True)
class BeamResult:
    sequences: torch.Tensor  # (B * num_return_sequences, out_len): the best finished hypotheses, best first
    running: torch.Tensor  # (B * num_beams, cur_len): the running hypotheses when the search stopped
    hypo_ids: list[int]  # which earlier row each running row continues (not yet applied to any cache)


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of `tensor` (B, n, ...) picked per prompt by `index` (B, k) -> (B, k, ...)."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


def beam_search(
    logits_fn: LogitsFn,
    input_ids: torch.Tensor,
    settings: BeamSettings,
    processors: LogitsProcessorList,
    criteria: StoppingCriteriaList,
) -> BeamResult:
    """Run beam search from `input_ids` (B * num_beams, L): each prompt repeated num_beams times, as HF expands it."""
    nb = settings.num_beams
    rows, prompt_len = input_ids.shape
    batch, max_len = rows // nb, settings.max_length
    keep = max(2, 1 + settings.n_eos) * nb
    top_nb = torch.cat([torch.ones(nb, dtype=torch.bool), torch.zeros(keep - nb, dtype=torch.bool)])  # (K,)

    running = torch.full((batch, nb, max_len), settings.fill_token, dtype=torch.long)  # (B, nb, max_len)
    running[:, :, :prompt_len] = input_ids.view(batch, nb, prompt_len)
    finished = running.clone()
    running_scores = torch.zeros(batch, nb)  # only beam 0 starts live, so the first step does not pick nb copies
    running_scores[:, 1:] = _NEG
    finished_scores = torch.full((batch, nb), _NEG)
    is_finished = torch.zeros(batch, nb, dtype=torch.bool)
    improvable = torch.ones(batch, 1, dtype=torch.bool)
    origin = torch.full((batch, nb, max_len - prompt_len), -1, dtype=torch.int32)  # row each token was appended to
    finished_origin = origin.clone()

    cur, hypo_ids = prompt_len, None
    while True:
        flat = running[:, :, :cur].reshape(rows, cur)  # (B * nb, cur)
        logits = logits_fn(flat, hypo_ids).to(torch.float32)  # (B * nb, V)
        log_probs = processors(flat, F.log_softmax(logits, dim=-1))
        vocab = log_probs.shape[-1]
        scores = (log_probs.view(batch, nb, vocab) + running_scores[:, :, None]).view(batch, nb * vocab)

        # candidates: the K best (or sampled) continuations over all beams of each prompt
        if settings.do_sample:
            top_index = torch.multinomial(F.softmax(scores, dim=-1), num_samples=keep)
            top_scores = torch.gather(scores, 1, top_index)
        else:
            top_scores, top_index = torch.topk(scores, k=keep)  # (B, K)
        from_beam = top_index // vocab  # (B, K)
        candidates = _gather(running, from_beam)  # (B, K, max_len)
        candidates[:, :, cur] = top_index % vocab
        cand_origin = _gather(origin, from_beam)
        cand_origin[:, :, cur - prompt_len] = from_beam + torch.arange(batch)[:, None] * nb
        ended = criteria(candidates[:, :, : cur + 1].reshape(batch * keep, cur + 1), None).view(batch, keep)

        # the nb best candidates that go on
        live_scores = top_scores + ended.to(torch.float32) * _NEG
        best = torch.topk(live_scores, k=nb)[1]
        running, running_scores, origin = (
            _gather(candidates, best),
            _gather(live_scores, best),
            _gather(cand_origin, best),
        )

        # finished hypotheses: merge in candidates among the top nb that just ended, if they score better
        just_ended = ended & top_nb[None, :]
        final_scores = top_scores / ((cur + 1 - prompt_len) ** settings.length_penalty)
        full = torch.all(is_finished, dim=-1, keepdim=True) & (settings.early_stopping is True)
        final_scores = final_scores + full.to(torch.float32) * _NEG
        final_scores = final_scores + (~improvable).to(torch.float32) * _NEG
        final_scores = final_scores + (~just_ended) * _NEG
        merged_scores = torch.cat([finished_scores, final_scores], dim=1)  # (B, nb + K)
        best = torch.topk(merged_scores, k=nb)[1]
        finished = _gather(torch.cat([finished, candidates], dim=1), best)
        finished_scores = _gather(merged_scores, best)
        finished_origin = _gather(torch.cat([finished_origin, cand_origin], dim=1), best)
        is_finished = _gather(torch.cat([is_finished, just_ended], dim=1), best)

        hypo_ids = origin[:, :, cur - prompt_len].reshape(rows).tolist()
        cur += 1
        improvable = _still_improvable(
            improvable, running_scores, finished_scores, is_finished, cur, prompt_len, settings
        )
        open_beams = not (bool(is_finished.all()) and settings.early_stopping is True)
        if not (bool(improvable.any()) and open_beams and not bool(ended.all())):
            break

    nrs = settings.num_return_sequences
    returned = finished[:, :nrs].reshape(batch * nrs, max_len)
    generated = int((finished_origin[:, :nrs].reshape(batch * nrs, -1) + 1).bool().sum(dim=1).max())
    return BeamResult(returned[:, : prompt_len + generated], running[:, :, :cur].reshape(rows, cur), hypo_ids)


def _still_improvable(
    improvable: torch.Tensor,
    running_scores: torch.Tensor,
    finished_scores: torch.Tensor,
    is_finished: torch.Tensor,
    cur: int,
    prompt_len: int,
    settings: BeamSettings,
) -> torch.Tensor:
    """(B, 1): could the best running beam still beat the worst finished one (HF's heuristic per early_stopping)."""
    if settings.early_stopping == "never" and settings.length_penalty > 0.0:
        best_length = settings.max_length - prompt_len
    else:
        best_length = cur - prompt_len
    best_running = running_scores[:, :1] / (best_length**settings.length_penalty)
    worst_finished = torch.where(is_finished, torch.min(finished_scores, dim=1, keepdim=True)[0], _NEG)
    return improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
