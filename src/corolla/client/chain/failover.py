"""Failover: what the chain does when a span fails a step, so that the caller sees nothing.

Who is at fault is decided by client.chain.failover_plan (pure, from the error alone); this module applies it to
the chain's route:

    relay          the step goes span by span through the client; a span that fails is banned, replaced by a
                   fresh route over exactly its blocks (possibly several smaller servers), its history replayed
                   into the replacement, and the step goes on from there
    repair_push    a pushed step that failed at span i: relay on from i + 1 (i answered but could not push), ask i
                   directly (it may never have been pushed the step), convict the pusher (its own receipt proves it
                   pushed something else than it returned), or replace i
    repair_pipe    steps in flight (or a chunked prefill) failed: cut every push link, replace the span at fault,
                   redo the unanswered steps one by one

Every function takes the chain and a `Step` (client.chain.steps): for a step relayed on from span i, its `hidden` is
span i's input.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import torch

from corolla.client.chain.failover_plan import culprit, repair_plan
from corolla.client.chain.pass_pipe import PassPipe, PipeFailed
from corolla.client.chain.push_route import can_push
from corolla.client.chain.route_opening import open_route
from corolla.client.chain.span_session import BadAnswer, PushFailed, new_secret
from corolla.client.chain.steps import Step
from corolla.protocol.errors import PeerUnavailable, RemoteError

if TYPE_CHECKING:
    from corolla.client.chain.chain import Chain

logger = logging.getLogger(__name__)


async def relay(chain: Chain, step: Step, index: int, failed: Exception | None = None) -> torch.Tensor:
    """Run `step` (its input: spans[index]'s) through spans[index:], the client relaying every hop; `failed`:
    spans[index] already failed it. Returns the last span's answer."""
    spans = chain.spans
    assert spans is not None
    failures, x = 0, step.hidden
    while index < len(spans):
        span = spans[index]
        try:
            if failed is not None:
                error, failed = failed, None
                raise error
            begin = time.perf_counter()  # routing: the span's measured time (SequenceManager.observe)
            out = await chain.watch(span, span.step(x, step.position, chain.config.request_timeout, step.mask,
                                                    step.hypo_ids, step.answer(index, len(spans))))
            chain.manager.observe(span.span.peer_id, time.perf_counter() - begin, span.span.length,
                                  x.shape[0] * x.shape[1])
        except (PeerUnavailable, RemoteError) as e:
            failures = chain.manager.after_failure(e, failures, span.span)
            if chain.standbys is None or not chain.standbys.ready(span):  # a standby needs no fresh view of the swarm
                await chain.manager.backoff(failures)
            await replace_span(chain, index, step.position)
            continue
        chain.accept(span, step, x, out)
        x, index = out, index + 1
    return x


async def repair_push(chain: Chain, step: Step, inputs: list[torch.Tensor], index: int, error: Exception
                      ) -> torch.Tensor:
    """spans[index] failed the pushed `step` with `error`; `inputs[: index + 1]` are the inputs of the spans up to
    it (their answers checked). Accept what is known good, then go on as failover_plan.repair_plan says."""
    spans = chain.spans
    assert spans is not None
    plan = repair_plan(index, error)
    logger.info("pushed step failed at span %d: %s (%s)", index, error, plan.action)
    if plan.action == "relay_on":  # spans[index] answered, the one after it did not get the step
        assert isinstance(error, PushFailed)
        inputs.append(error.output)
        chain.accept_all(spans[: index + 1], step, inputs)
        return await relay(chain, step.carrying(error.output), plan.start)
    chain.accept_all(spans[: plan.start], step, inputs)
    if plan.action == "convict_pusher":
        assert isinstance(error, BadAnswer)
        return await _convict_pusher(chain, step.carrying(inputs[plan.start]), plan.start, error)
    if plan.action == "relay_unpushed":
        return await _relay_unpushed(chain, step.carrying(inputs[index]), index, error)
    return await relay(chain, step.carrying(inputs[index]), index, error)


async def _relay_unpushed(chain: Chain, step: Step, index: int, error: Exception) -> torch.Tensor:
    """spans[index] did not run a pushed step (silent about it, or refusing it as not what its pusher signed): send
    it the step directly. If it answers now, the link from the server before it failed, and neither side is proven at
    fault: the link is cut for this session (its steps go by relay while that pair is on its route) and counted in
    the client's link record, which bans a peer that keeps being the common factor of failed links
    (client.swarm.links). If it does not answer, spans[index] failed."""
    spans = chain.spans
    assert spans is not None
    span, pusher = spans[index], spans[index - 1]
    try:
        out = await chain.watch(span, span.step(step.hidden, step.position, chain.config.request_timeout, step.mask,
                                                step.hypo_ids, step.answer(index, len(spans))))
    except (PeerUnavailable, RemoteError) as e:
        return await relay(chain, step, index, e)
    link = (pusher.span.peer_id, span.span.peer_id)
    logger.warning("server %s answered the step relayed to it, but not when %s pushed it (%s); relaying that link",
                   link[1], link[0], error)
    chain.cut_links.add(link)
    chain.manager.link_failed(*link)
    chain.accept(span, step, step.hidden, out)
    return await relay(chain, step.carrying(out), index + 1)


async def _convict_pusher(chain: Chain, step: Step, index: int, error: BadAnswer) -> torch.Tensor:
    """spans[index] pushed something else than it returned (its signed receipt proves it): distrust it, replace it,
    rebuild the caches of every span after it from their histories (its pushes reached them), and relay the step
    from it (`step.hidden`: its input)."""
    spans = chain.spans
    assert spans is not None
    distrust(chain, spans[index].span.peer_id, error.blame.reason)
    added = await replace_span(chain, index, step.position)
    for later in chain.spans[index + added :]:
        if later.history is not None and later.history.shape[1] >= step.position > 0:
            replay = Step(later.history[:, : step.position], 0, chain.state.replay_mask(step.position))
            out = await later.step(replay.hidden, 0, chain.config.request_timeout, replay.mask)
            chain.accept(later, replay, replay.hidden, out, replay=True)
    return await relay(chain, step, index)


def distrust(chain: Chain, peer_id: str, reason: str) -> None:
    """Never route through `peer_id` again in this client (proven wrong), and keep it in the reputation record."""
    logger.warning("distrusting peer=%s: %s", peer_id, reason)
    if chain.checks is not None:
        chain.checks.on_distrust(peer_id)
    chain.manager.distrusted.add(peer_id)


async def replace_span(chain: Chain, index: int, position: int) -> int:
    """Close spans[index] and put its standby in its place (client.chain.standby: nothing replayed), or else open a
    fresh route over its blocks, replaying its inputs before `position`; returns how many spans took its place.
    The spans that took it get standbys of their own, in the background."""
    spans = chain.spans
    assert spans is not None
    span = spans[index]
    await span.close()
    standbys = chain.standbys
    promoted = None if standbys is None else await standbys.promote(span, position)
    if promoted is not None:
        replacement = [promoted]
    else:
        history = span.history[:, :position] if span.history is not None else None
        replacement = await open_route(chain, span.span.start, span.span.end, history, fresh=False)
    spans[index : index + 1] = replacement
    if standbys is not None:
        standbys.cover(replacement)
    if index > 0:
        # the link into it gets a fresh secret, so a push over the old link can only reach the old session (which
        # may still be closing on the same server), never the replacement
        spans[index - 1].secret = new_secret()
    return len(replacement)


# ---------------------------------------------------------------------- steps redone whole
async def unlink_and_blame(chain: Chain, failed: PipeFailed, position: int) -> None:
    """After steps in flight failed: cut every push link (the steps still on their way are refused from then on),
    then replace the span at fault, if any, replaying its inputs before `position`. Nobody is replaced when the span
    could not push on, or did not answer a push that may never have come: the redo finds out."""
    spans = chain.spans
    assert spans is not None
    await asyncio.gather(
        *(s.set_push(None, None, chain.config.connect_timeout) for s in spans), return_exceptions=True
    )
    fault = culprit(failed.index, failed.error)  # client.chain.failover_plan
    if fault is None:
        return
    peer = spans[fault.index].span.peer_id
    if fault.distrust:
        assert isinstance(failed.error, BadAnswer)
        distrust(chain, peer, failed.error.blame.reason)
    else:  # re-raises what no other server would fix
        chain.manager.after_failure(failed.error, 0, spans[fault.index].span)
    await replace_span(chain, fault.index, position)


async def repair_pipe(chain: Chain, pipe: PassPipe) -> None:
    """The pipe of steps in flight failed: redo its unanswered steps (once, however many callers wait)."""
    if chain.repairing is None:
        chain.repairing = asyncio.ensure_future(_redo_pipe(chain, pipe))
    await asyncio.shield(chain.repairing)


async def _redo_pipe(chain: Chain, pipe: PassPipe) -> None:
    """Cut every push link, handle the span at fault, and run the unanswered steps again one by one (relayed where
    needed, with failover)."""
    try:
        failed = pipe.failure.result()
        todo = pipe.unanswered()
        await pipe.close()
        logger.info("steps in flight failed at span %d: %s; redoing %d", failed.index, failed.error, len(todo))
        await unlink_and_blame(chain, failed, todo[0].position if todo else chain.state.position)
        for handle in todo:
            if handle.cancelled:
                continue
            output = await redo(chain, handle.step)
            if not handle.result.done():
                handle.result.set_result(output)
    except BaseException as e:
        for handle in pipe.unanswered():
            if not handle.result.done():
                handle.result.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
        raise
    finally:
        chain.pipe = None
        chain.repairing = None


async def redo(chain: Chain, step: Step) -> torch.Tensor:
    """Run a submitted step again at its position, by push where the route can, else relayed."""
    assert chain.spans is not None
    if can_push(len(chain.spans), chain.config.push, step.position, 0):
        return await chain.push(step)
    return await relay(chain, step, 0)
