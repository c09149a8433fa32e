"""What a client accepts from its servers, and whom it blames for what it does not: pure rules, no I/O.

An answer to a step must be well formed (`answer_problem`): the step's shape, finite, and of a sane size. A server
whose answer is not is at fault itself, whatever its input was: the client checks every input it forwards, and a
pushed input is the previous server's copy, which the client checked first.

In push mode server B's input is what server A pushed, which the client never sees; B hands the client A's signed
receipt of it (protocol.receipts), and `judge_receipt` reads it against what the client knows: the step it sent, the
link's secret, and A's own copy of its output (with the step's mask):

    no receipt, not A's signature over this link, or for another step   ->  B lies ("receiver")
    A's valid receipt, but of other tensors or step fields               ->  A lies ("pusher"): proven by its signature
    A's valid receipt of exactly what A told the client                  ->  nobody (B computed from the right input)

An answer to a step the client never sent (a newer step id than its last: `judge_unsent`) means someone rewrote the
session: A, if B hands A's valid receipt of that step (A pushed a step nobody asked for, attack 2 of the insider round:
an upstream operator rewriting the next server's cache), else B. Answers to older steps need no judgment: a server
applies a pushed step only when its id is newer than the session's last (server.rpc.inference), so an older answer is
a late one the client skips.

So one server's word never convicts another: B cannot blame A without A's signature, and A cannot push one thing
and tell the client another without signing the proof.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from corolla.protocol.errors import PeerUnavailable
from corolla.protocol.messages import PushReceipt
from corolla.protocol.receipts import receipt_signed

MAX_GROWTH = 1e4  # an answer's row norm may exceed (its input's + 1) by at most this factor; more is garbage


@dataclass(frozen=True)
class Blame:
    """Who is at fault for a pushed step's answer, and why."""

    who: Literal["pusher", "receiver"]
    reason: str


class BadAnswer(PeerUnavailable):
    """A server's answer was malformed or dishonest; `blame` says whose fault: the answering server's ("receiver"),
    or, for a pushed step, the pusher's, proven by its own signed receipt ("pusher")."""

    own_doing = True  # banned for max_backoff at the least (client.swarm.sequence_manager)

    def __init__(self, peer_id: str, blame: Blame):
        super().__init__(f"server {peer_id}: {blame.reason}")
        self.blame = blame


def answer_problem(output: torch.Tensor, step_input: torch.Tensor, answer: int | None = None) -> str | None:
    """None if `output` is a well-formed answer to a step whose input was `step_input` (B, T, H), of which only the
    last `answer` positions were asked for (None: all); else what is wrong: another shape, a NaN or inf, or rows far
    larger than any block stack makes of its input (MAX_GROWTH)."""
    if answer is not None:
        step_input = step_input[:, step_input.shape[1] - min(answer, step_input.shape[1]) :]
    if output.shape != step_input.shape:
        return f"returned shape {tuple(output.shape)} for an input of shape {tuple(step_input.shape)}"
    if not output.is_floating_point():
        return f"returned dtype {output.dtype}"
    values = output.float()
    if not bool(torch.isfinite(values).all()):
        return "returned NaN or inf"
    if values.numel():
        limit = MAX_GROWTH * (step_input.float().norm(dim=-1) + 1.0)  # (B, T)
        if bool((values.norm(dim=-1) > limit).any()):
            return f"returned values more than {MAX_GROWTH:g} times larger than its input"
    return None


def judge_receipt(
    receipt: PushReceipt | None,
    *,
    pusher: str,
    receiver: str,
    secret: str,
    step_id: int,
    position: int,
    hypo_ids: Sequence[int] | None,
    digest: str,
    answer: int | None = None,
) -> Blame | None:
    """Whom to blame for the pushed input behind `receiver`'s answer to step `step_id` (see the module docstring);
    None when the receipt shows `receiver` got exactly what `pusher` told the client (`digest`: of the pusher's copy
    and the step's mask) as the step the client sent (`position`, `hypo_ids`, pushed on)."""
    if receipt is None:
        return Blame("receiver", "its answer to a pushed step carries no receipt of its input")
    if receipt.pusher != pusher or receipt.receiver != receiver:
        return Blame(
            "receiver", f"it presented a receipt from {receipt.pusher} to {receipt.receiver}, not from {pusher}"
        )
    if not receipt_signed(receipt, secret):
        return Blame("receiver", f"it presented a receipt that is not {pusher}'s signature over this session's link")
    if receipt.step_id != step_id:
        return Blame("receiver", f"it answered step {step_id} with the receipt of step {receipt.step_id}")
    ids = None if hypo_ids is None else list(hypo_ids)
    if (receipt.position, receipt.hypo_ids, receipt.push, receipt.answer) != (position, ids, True, answer):
        return Blame(
            "pusher",
            f"it pushed step {step_id} at position {receipt.position} (hypo_ids {receipt.hypo_ids}, "
            f"push {receipt.push}, answer {receipt.answer}) where the client sent position "
            f"{position} (hypo_ids {ids}, answer {answer})",
        )
    if receipt.digest != digest:
        return Blame("pusher", "it pushed other tensors than the output it returned to the client (signed receipt)")
    return None


def judge_unsent(receipt: PushReceipt | None, *, pusher: str, receiver: str, secret: str, step_id: int,
                 expected: int) -> Blame:
    """Whom to blame for `receiver`'s answer to step `step_id`, newer than `expected` (the last step the client sent
    or pushed): `pusher`, when the receipt is its valid signature of that step over this link; else `receiver`."""
    if (receipt is not None and receipt.pusher == pusher and receipt.receiver == receiver
            and receipt.step_id == step_id and receipt_signed(receipt, secret)):
        return Blame("pusher", f"it pushed step {step_id} into the session on {receiver}, a step the client never "
                               f"sent (its last was {expected}): a rewrite of that server's cache, signed")
    return Blame("receiver", f"it answered step {step_id}, which the client never sent (its last was {expected})")
