"""Fault injection for failure tests: `corolla serve ... --inject-fault fail|drop|stall|corrupt|...`, armed by SIGUSR1.

`FaultInjector` wraps the server's `Compute` (server.compute.scheduling). A server started without --inject-fault has no
wrapper at all, and until SIGUSR1 arms it the wrapper passes every call through. Once armed:

- fail:    every inference step is answered with an `internal` error;
- drop:    every inference step ends its stream without an answer (`Hangup`);
- stall:   every inference step gets no answer for `stall_seconds` (the server's step timeout), then a `timeout`;
- corrupt: every output goes back subtly wrong: inference steps and forward passes answer the span's last block
           output with its first half of hidden features scaled by CORRUPT_SCALE (1.01). The stream, the cache and
           the timing stay as they were, so only checking the numbers (spot checks against another server) can
           tell. Backward passes are left alone.
- slow:    every inference step is answered honestly, SLOW_STEP_SECONDS (0.1 s) late: a slow server, so that a test
           can keep a client's steps in flight on loopback whatever the machine's load.

The hostile modes below attack the trust model (docs/security.md) rather than fail; each is a test's liar:

- corrupt-push:    what it pushes to the next server is corrupted as above (and signed as pushed); what it answers
                   the client is honest. Without push receipts this got the honest next server convicted.
- misdigest-push:  what it pushes is corrupted, under a receipt signed over the honest output it answers the client
                   with: the receiver refuses it (PushRefused DIGEST), and the pusher's word stands against the
                   receiver's (client.swarm.links). Without that, every step stalled for the request timeout.
- rewrite-push:    pushes a corrupted copy of each output as the *next* step, one the client never sent (id + 1),
                   signed as pushed: the receiver runs it (a newer id) and the client, handed an answer to a step it
                   never sent with the pusher's valid receipt, convicts the pusher (client.chain.push_audit).
- lie-to-checkers: inference steps are honest; forward passes (what spot checks call) are corrupted, to get the
                   honest servers it checks distrusted.
- nan:             inference steps answer NaN (to the client and to the next server).
- false-quant:     announces nf4 quantization (whose honest error is large) from the start, while it computes in its
                   real dtype; once armed its outputs get a bias (half the features scaled by FALSE_QUANT_SCALE) that
                   nf4's tolerance against float32 would hide.

Why not scale the whole output: every block and the final norm normalise their input (RMSNorm, LayerNorm), so a
uniform 1% scale of the model's last hidden states changes no logit, and in the middle of the model it changes
only the residual's weight. Scaling half the features turns the vector, which no normalisation undoes.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from torch import Tensor

from corolla.protocol.messages import ComputeKind, ErrorCode
from corolla.server.compute.planner import Plan, Step
from corolla.server.compute.scheduling import Compute
from corolla.server.rpc.sessions import ServerSession
from corolla.server.errors import RequestError

logger = logging.getLogger(__name__)

FAULT_MODES = ("fail", "drop", "stall", "corrupt", "corrupt-push", "misdigest-push", "rewrite-push", "lie-to-checkers",
               "nan", "false-quant", "slow")
SLOW_STEP_SECONDS = 0.1
CORRUPT_SCALE = 1.01
FALSE_QUANT_SCALE = 1.1  # moves a span's output by ~7e-2 relative: far past float32's tolerance, inside nf4's


def corrupted(output: Tensor, scale: float = CORRUPT_SCALE) -> Tensor:
    """output (B, T, H) with features [0, H // 2) scaled by `scale`, out of place."""
    out = output.clone()
    out[..., : output.shape[-1] // 2] *= scale
    return out


def announced_quant(mode: str | None, quant: str) -> str:
    """The quantization a server with fault `mode` announces: its real `quant`, except under false-quant."""
    return "nf4" if mode == "false-quant" else quant


class Hangup(Exception):
    """End this stream at once, without an answer (the stream handler closes it silently)."""


class FaultInjector:
    """`Compute` that misbehaves as `mode` says once `arm()` was called; until then it is `inner` itself."""

    def __init__(self, inner: Compute, mode: str, stall_seconds: float):
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault {mode!r}; choose one of {', '.join(FAULT_MODES)}")
        self.inner = inner
        self.mode = mode
        self.stall_seconds = stall_seconds
        self.armed = False

    def arm(self) -> None:
        logger.warning("fault armed: from now on inference steps %s (--inject-fault)", self.mode)
        self.armed = True

    @property
    def signs_honest_output(self) -> bool:
        """Whether the receipt of a push signs the honest output whatever is pushed (misdigest-push)."""
        return self.armed and self.mode == "misdigest-push"

    @property
    def pushed_step_offset(self) -> int:
        """What to add to the id of a step pushed on (rewrite-push: 1, a step the client never sent)."""
        return 1 if self.armed and self.mode == "rewrite-push" else 0

    def pushed(self, output: Tensor) -> Tensor:
        """What to push on to the next server instead of `output` (corrupt-push, misdigest-push and rewrite-push,
        once armed)."""
        if self.armed and self.mode in ("corrupt-push", "misdigest-push", "rewrite-push"):
            logger.warning("injecting fault '%s' into a pushed step", self.mode)
            return corrupted(output)
        return output

    async def step(self, session: ServerSession, step: Step, plan: Plan) -> Tensor:
        if not self.armed or self.mode in ("corrupt-push", "misdigest-push", "rewrite-push", "lie-to-checkers"):
            return await self.inner.step(session, step, plan)
        if self.mode == "nan":
            logger.warning("injecting fault 'nan' into an inference step")
            return torch.full_like(await self.inner.step(session, step, plan), float("nan"))
        if self.mode == "false-quant":
            return corrupted(await self.inner.step(session, step, plan), FALSE_QUANT_SCALE)
        if self.mode == "slow":
            await asyncio.sleep(SLOW_STEP_SECONDS)
            return await self.inner.step(session, step, plan)
        logger.warning("injecting fault %r into an inference step", self.mode)
        if self.mode == "fail":
            raise RequestError(ErrorCode.INTERNAL, "injected fault")
        if self.mode == "drop":
            raise Hangup()
        if self.mode == "stall":
            await asyncio.sleep(self.stall_seconds)
            raise RequestError(ErrorCode.TIMEOUT, "injected stall")
        return corrupted(await self.inner.step(session, step, plan))

    async def forward(self, hidden: Tensor, start: int, end: int, adapter: str | None, prompts: Tensor | None,
                      mask: Tensor | None, kind: ComputeKind | None = None) -> Tensor:
        output = await self.inner.forward(hidden, start, end, adapter, prompts, mask, kind)
        if self.armed and self.mode in ("corrupt", "lie-to-checkers"):
            logger.warning("injecting fault %r into a forward pass", self.mode)
            return corrupted(output)
        if self.armed and self.mode == "false-quant":
            return corrupted(output, FALSE_QUANT_SCALE)
        return output

    async def backward(self, hidden: Tensor, grad_output: Tensor, start: int, end: int, adapter: str | None,
                       prompts: Tensor | None, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return await self.inner.backward(hidden, grad_output, start, end, adapter, prompts, mask)
