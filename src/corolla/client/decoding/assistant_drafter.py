"""Drafts from a small local model with the target's tokenizer (HF's `assistant_model`), with its own KV cache.

Each step the assistant continues the sequence token by token, with the target's logits processors and decoding mode
(argmax, or a draw from its processed distribution when sampling: those scores go with the draft, for the
speculative sampling rule), as HF's `AssistedCandidateGenerator` drives it. A row stops drafting after eos or after a
token the assistant gave less than `assistant_confidence_threshold` probability (HF's ConfidenceCriteria, at a
fixed threshold), and every row stops at `num_assistant_tokens`. With `num_assistant_tokens_schedule="heuristic"`
that number grows by 2 after a step that kept the whole draft and shrinks by 1 (to at least 1) otherwise, and the
last value is written to the assistant's `generation_config` (kept for the next call, as HF does);
"heuristic_transient" adapts within the call only, "constant" never.

The assistant's KV cache lives across steps: before drafting, it is cut back to the longest prefix it shares with
the sequence (the rejected draft tokens go), and only the tokens after that are run.

    cache:    a b c d1 d2            (d3 was proposed, never run)
    sequence: a b c d1 t1            (d2 rejected, t1 the target's)  ->  keep a b c d1, run t1, draft on
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList

from corolla.client.decoding.speculative import Draft

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


class AssistantDrafter:
    """Drafts from `assistant` (an HF causal LM: `model(input_ids, attention_mask, position_ids, cache) -> .logits`).

    `processors` are the target's (HF gives the assistant the target's settings); `num_tokens`, `schedule` and
    `confidence` are num_assistant_tokens, num_assistant_tokens_schedule and assistant_confidence_threshold."""

    def __init__(self, assistant: nn.Module, processors: LogitsProcessorList, eos: list[int], do_sample: bool,
                 num_tokens: int, schedule: str = "constant", confidence: float = 0.0):
        if schedule not in SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if num_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be >= 1, got {num_tokens}")
        self.assistant = assistant
        self.processors = processors
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.do_sample = do_sample
        self.num_tokens = num_tokens
        self.schedule = schedule
        self.confidence = confidence
        self.device = next(assistant.parameters()).device
        params = inspect.signature(assistant.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5.x renamed it
        self._logits_to_keep = "logits_to_keep" in params
        self._cache: DynamicCache | None = None
        self._cached = torch.empty(0, 0, dtype=torch.long)  # (rows, c): the tokens in the cache

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, sequence: Tensor, mask: Tensor | None, free: Tensor, fill: int, limit: int) -> Draft:
        """Up to min(num_tokens, limit) tokens per row after `sequence` (rows, s) (see speculative.Drafter)."""
        rows = sequence.shape[0]
        budget = min(self.num_tokens, limit)
        if budget <= 0:
            return Draft.empty(rows)
        logits = self._run_sequence(sequence, mask)  # (rows, V) at the last position
        full_mask = mask
        context = sequence
        tokens, scores = [], []
        lengths = torch.zeros(rows, dtype=torch.long)
        drafting = ~free
        for step in range(budget):
            processed = self.processors(context, logits.float())  # (rows, V)
            if self.do_sample:
                chosen = torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1).squeeze(1)
            else:
                chosen = processed.argmax(dim=-1)
            chosen = torch.where(free, torch.full_like(chosen, fill), chosen)
            tokens.append(chosen)
            scores.append(processed)
            lengths = lengths + drafting.to(torch.long)
            drafting = drafting & ~self._stops(chosen, processed)
            context = torch.cat([context, chosen[:, None]], dim=1)
            if full_mask is not None:
                full_mask = torch.cat([full_mask, torch.ones(rows, 1, dtype=torch.bool)], dim=1)
            if step == budget - 1 or not bool(drafting.any()):
                break
            logits = self._forward(chosen[:, None], full_mask)[:, -1]
        draft = torch.stack(tokens, dim=1)  # (rows, k)
        lengths = torch.where(free, torch.full_like(lengths, draft.shape[1]), lengths)
        return Draft(draft, lengths, torch.stack(scores, dim=1))

    def update(self, accepted: int, drafted: int) -> None:
        """The heuristic schedules: +2 after a step that kept its whole draft, else -1 (at least 1)."""
        if self.schedule != "constant":
            self.num_tokens = self.num_tokens + 2 if accepted == drafted else max(1, self.num_tokens - 1)

    def _stops(self, chosen: Tensor, processed: Tensor) -> Tensor:
        """Rows (rows,) that stop drafting after `chosen`: eos, or probability below the confidence threshold."""
        stop = torch.isin(chosen, self.eos) if self.eos.numel() else torch.zeros_like(chosen, dtype=torch.bool)
        if self.confidence > 0:
            prob = torch.softmax(processed, dim=-1).gather(1, chosen[:, None]).squeeze(1)
            stop = stop | (prob < self.confidence)
        return stop

    # ------------------------------------------------------------------ the assistant's cache
    def _run_sequence(self, sequence: Tensor, mask: Tensor | None) -> Tensor:
        """Bring the cache to `sequence` (rows, s) (cut to the shared prefix, run the rest); the last logits (rows,
        V)."""
        rows, length = sequence.shape
        keep = 0
        if self._cache is not None and self._cached.shape[0] == rows:
            width = min(self._cached.shape[1], length - 1)  # the last token is always run: its logits are needed
            differs = (self._cached[:, :width] != sequence[:, :width]).any(dim=0).nonzero()
            keep = int(differs[0]) if differs.numel() else width
        if self._cache is None or self._cached.shape[0] != rows or keep == 0:
            self._cache = _new_cache(self.assistant)
            self._cached = sequence[:, :0]
            keep = 0
        elif self._cached.shape[1] > keep:
            self._cache.crop(-(self._cached.shape[1] - keep))  # negative: remove that many (transformers 4.x and 5.x)
            self._cached = self._cached[:, :keep]
        return self._forward(sequence[:, keep:], mask)[:, -1]

    def _forward(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        """Run ids (rows, t) after the cached tokens; `mask` (rows, cached + t) or None. Returns the last position's
        logits (rows, 1, V) float32."""
        start = self._cached.shape[1]
        kwargs = {self._cache_arg: self._cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if mask is not None and not bool(mask.all()):
            attention = mask[:, : start + ids.shape[1]].to(torch.long)
            positions = (attention.cumsum(dim=1) - 1).masked_fill(attention == 0, 1)  # HF's positions for padding
            kwargs["attention_mask"] = attention.to(self.device)
            kwargs["position_ids"] = positions[:, start:].to(self.device)
        out = self.assistant(input_ids=ids.to(self.device), **kwargs)
        self._cached = torch.cat([self._cached, ids.cpu()], dim=1)
        return out.logits[:, -1:].float().cpu()


def _new_cache(model: nn.Module) -> DynamicCache:
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers without config-built caches
        cache = DynamicCache()
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers can then be cropped back
        cache.activate_past_recording()
    return cache
