"""BatchedEngine: every active choice of every request, generated together on the client's event loop.

Each choice has its own InferenceSession on the swarm (the servers batch the decode steps of all sessions). The
client side is batched here, once per step over every stream whose last hidden state has come back: one LM-head
matmul, one sampling pass (each row with its own settings and generator), one embedding lookup of the sampled
tokens; then every stream's session steps concurrently. That CPU work runs in one head thread so the event loop
keeps serving the P2P streams meanwhile.

    HTTP loop (uvicorn)                     client loop (corolla-client-loop)          head thread
    submit() ── call_soon_threadsafe ──>    _admit -> _prefill task (session, prompt)
                                            _run: ready streams ────────────────────>  logits, sample, embed
    StreamHandle.next() <── events ───────  post events; step each session (tasks) <──
    cancel() ─── call_soon_threadsafe ──>   _cancel: close the session at once

Streams are split into `pipeline_groups` groups (a new stream joins the smallest), and each group has its own
head pass: while one group's step runs on the second server of the route, the next group's runs on the first, so
the servers of a route work at the same time instead of in turn. On one 2-core machine, where the servers share the
cores, two groups measured 0.91x of one, so the default is one group.
Before a group's head pass, the engine waits for its decode steps still in flight, but only until they are overdue
(3x the usual step time after their launch):
streams that drifted apart (a prefill that finished in between) fall back into one batch within a step, while one
slow stream (failover) does not hold back the others.
Prefills run beside the decode steps and join the next batch. Finished sessions are kept (sessions.IdleSessions),
per owner (API key), so a follow-up prompt of the same key sends only its new tokens; when a server is too full to
open a session, kept sessions are given up first (the largest holder's oldest first).

One stream cannot fail the others of its batch: request values are bounded before they get here (schemas.py,
app.py), and should a shared head pass still fail (a bug, a row nobody foresaw), it is run again row by row, each
row's random generator rewound to where the batch found it, and only the rows that fail alone end, with their
error. Each owner may have at most `max_streams_per_key` streams in the engine (quota.StreamQuota).

With spot checks on (ClientConfig.verify_rate > 0), a stream whose session found a lying server is generated again
from where the lie began, before its next head pass (api.rewinds: the liar replaced, the session rolled back, the
tokens from there dropped and sampled anew with the same draws). Its events are held back: a whole response gets
them once the choice is complete and the checks in flight are done (up to ClientConfig.verify_wait), so it is
always corrected; a streamed one gets each token once the checks covering its step passed, and should a correction
contradict text already sent, the stream ends with an error (OutputRetracted) rather than go on with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import torch

from corolla.api.capacity import SwarmCapacity
from corolla.api.config import ApiConfig
from corolla.api.errors import EngineClosed, OutputRetracted, TooManyStreams
from corolla.api.handle import StreamHandle
from corolla.api.metrics import ApiMetrics
from corolla.api.head_pass import HeadPass
from corolla.api.quota import StreamQuota
from corolla.api.rewinds import HeldEvents, released_tokens, rewind_choice
from corolla.api.sampling import SamplingParams, make_generator
from corolla.api.sessions import IdleSessions
from corolla.api.stream import GenerationStream, StreamEvent
from corolla.client.decoding.stepper import Stepper
from corolla.client.event_loop import get_loop, run_sync
from corolla.client.session.inference_session import InferenceSession
from corolla.client.trust.spot_checks import SessionChecks
from corolla.protocol.errors import AllocationFailed

logger = logging.getLogger(__name__)

OVERDUE = 3.0  # a decode step is waited for until this many usual step times after its launch
MIN_PATIENCE = 0.25  # seconds after its launch a decode step is always waited for (CPU contention delays some)
MAX_GATHER_WAIT = 2.0  # seconds a head pass waits at most for decode steps in flight
STEP_TIME_SMOOTHING = 0.2  # weight of a new sample in the usual decode step time


@dataclass(eq=False)
class _Active:
    handle: StreamHandle
    stream: GenerationStream
    session: InferenceSession | None = None
    stepper: Stepper | None = None  # steps the session, as generate's loops do (client.decoding.stepper)
    hidden: torch.Tensor | None = None  # (H,) the last block's output at the last position: ready for the head
    task: asyncio.Task[None] | None = None  # the prefill or decode step in flight
    decoding: bool = False  # task is a decode step (prefills are not waited for)
    launched: float = 0.0  # when the decode step in flight was launched (monotonic seconds)
    group: int = 0  # pipeline group: the streams of a group share head passes
    owner: str = ""  # the API key (its id) the stream runs for: its kept sessions and its quota
    counted: bool = False  # the stream holds one of its owner's quota (given back when it ends)
    held: HeldEvents = field(default_factory=lambda: HeldEvents(False))  # events waiting for spot checks
    done: bool = False


class BatchedEngine:
    """Generation for the API. `submit`, `cancel` and `close` may be called from any thread; the rest runs on the
    client's event loop."""

    def __init__(self, model: Any, tokenizer: Any, config: ApiConfig, metrics: ApiMetrics, max_length: int):
        self.model = model  # a DistributedModelForCausalLM: head.embed, head.logits, open_session
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.max_length = max_length  # tokens one session may hold
        self.head_pass = HeadPass(model, metrics)
        self.vocab_size = self.head_pass.vocab_size  # width of the logits
        self.token_limit = self.head_pass.token_limit  # ids the model takes as input
        self.quota = StreamQuota(config.max_streams_per_key if config.api_keys else None)
        self._loop = get_loop()
        self._head = ThreadPoolExecutor(1, thread_name_prefix="corolla-api-head")
        self._active: dict[StreamHandle, _Active] = {}
        self._waiting: list[_Active] = []
        self._idle: IdleSessions[InferenceSession] = IdleSessions(config.max_idle_sessions, config.idle_timeout,
                                                                  config.min_reuse_tokens)
        self._background: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._step_time: float | None = None  # usual duration of a decode step (smoothed), seconds
        self._capacity = SwarmCapacity(model.sequence_manager)
        self._opening = 0  # cache tokens of the sessions being opened now (maybe not reserved on the servers yet)
        self._closing = False

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        async def start() -> None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run())
            self._task.add_done_callback(_log_crash)

        run_sync(start())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit_request(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                       owner: str = "", streamed: bool = False) -> list[StreamHandle]:
        """Start every choice of one request (`n` per prompt; choice p * n + j is copy j of prompt p), all or none;
        call from a running event loop (the handles' events are queued there). `streamed`: as `submit` takes it.
        Raises TooManyStreams when they would bring `owner` past its stream quota, EngineClosed after close()."""
        count = len(prompts) * n
        if not self.quota.take(owner, count):
            raise TooManyStreams(f"this API key may have at most {self.quota.limit} streams generating or waiting "
                                 f"at once; it has {self.quota.held(owner)} and the request asks for {count}")
        handles: list[StreamHandle] = []
        try:
            for ids in prompts:
                for j in range(n):
                    handles.append(self.submit(ids, params, j, owner, counted=True, streamed=streamed))
                    count -= 1
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        finally:
            if count:
                self.quota.give_back(owner, count)
        return handles

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, index: int = 0, owner: str = "",
               counted: bool = False, streamed: bool = False) -> StreamHandle:
        """Start generating one choice for `owner`; call from a running event loop (the handle's events are queued
        there). `index` tells a request's choices apart (their seeded generators differ); `counted`: the stream
        was taken from the owner's quota (given back when it ends); `streamed`: the caller sends tokens as they
        come, so with spot checks on each is posted once the checks covering it passed (otherwise all at the end).
        Raises EngineClosed after close()."""
        if self._closing:
            raise EngineClosed("the API is shutting down")
        handle = StreamHandle(self.cancel, asyncio.get_running_loop())
        stream = GenerationStream(prompt_ids, params, self.tokenizer, self.vocab_size,
                                  make_generator(params.seed, index))
        self.metrics.prompt_tokens.inc(len(stream.prompt_ids))
        active = _Active(handle, stream, owner=owner, counted=counted, held=HeldEvents(streamed))
        self._loop.call_soon_threadsafe(self._admit, active)
        return handle

    def cancel(self, handle: StreamHandle) -> None:
        try:
            self._loop.call_soon_threadsafe(self._cancel, handle)
        except RuntimeError:  # the client loop is gone (interpreter shutdown)
            pass

    def close(self, timeout: float = 30.0) -> None:
        """Fail every running choice and close every session, kept ones included."""
        if not self._closing:
            self._closing = True
            run_sync(self._shutdown(), timeout=timeout)
            self._head.shutdown(wait=False)

    # ------------------------------------------------------------------ client loop: admission and endings
    def _admit(self, active: _Active) -> None:
        if self._closing:
            active.handle.post(StreamEvent(error=EngineClosed("the API is shutting down")))
        elif len(self._active) >= self.config.max_streams:
            self._waiting.append(active)
        else:
            sizes = [0] * self.config.pipeline_groups
            for other in self._active.values():
                sizes[other.group] += 1
            active.group = sizes.index(min(sizes))
            self._active[active.handle] = active
            self.metrics.active_streams.set(len(self._active))
            active.task = self._loop.create_task(self._beside(active, lambda: self._prefill(active)))

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._active) < self.config.max_streams:
            self._admit(self._waiting.pop(0))

    def _remove(self, active: _Active) -> bool:
        """Take the stream out of the engine; False if it was already out."""
        if active.done:
            return False
        active.done = True
        if active.counted:
            self.quota.give_back(active.owner)
        if self._active.pop(active.handle, None) is None and active in self._waiting:
            self._waiting.remove(active)
        self.metrics.active_streams.set(len(self._active))
        self._admit_waiting()
        return True

    def _cancel(self, handle: StreamHandle) -> None:
        active = self._active.get(handle) or next((a for a in self._waiting if a.handle is handle), None)
        if active is None or not self._remove(active):
            return
        logger.debug("stream cancelled by the client; closing its session")
        if active.task is not None and not active.task.done():
            active.task.cancel()
        self._close_later(active.session, None)
        active.session = None

    def _fail(self, active: _Active, error: BaseException) -> None:
        if not self._remove(active):
            return
        logger.info("generation failed: %s", error)
        active.handle.post(StreamEvent(error=error))
        self._close_later(active.session, None)
        active.session = None

    def _finish(self, active: _Active) -> None:
        """The choice is complete: keep its session for prefix reuse (or close it)."""
        if not self._remove(active):
            return
        session, active.session = active.session, None
        if session is None:
            return
        held = session.token_ids[0, : session.position].tolist()  # the last sampled token was never sent
        for dropped in self._idle.put(session, held, session.max_length, time.monotonic(), active.owner):
            self._close_later(dropped, "count" if dropped is not session else None)
        self.metrics.idle_sessions.set(len(self._idle))

    def _close_later(self, session: InferenceSession | None, reason: str | None) -> None:
        if session is None:
            return
        if reason is not None:
            self.metrics.idle_sessions_closed.labels(reason).inc()
        task = self._loop.create_task(self._close(session))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _close(self, session: InferenceSession) -> None:
        # InferenceSession.close waits on this very loop, so it runs in a worker thread
        try:
            await self._loop.run_in_executor(None, session.close)
        except Exception as e:  # the servers time the session out instead
            logger.debug("closing a session failed: %s", e)

    # ------------------------------------------------------------------ client loop: sessions
    async def _beside(self, active: _Active, work: Callable[[], Awaitable[torch.Tensor | None]]) -> None:
        """Run a stream's `work()` beside the decode steps (its prefill, a rewind): the last hidden state of what it
        returns is the stream's next head input (None: the stream is done); an error ends this stream alone; either
        way the engine's loop is woken. (A callable, not a coroutine: a task cancelled before it starts leaves no
        coroutine unawaited.)"""
        try:
            output = await work()
            if output is not None:
                active.hidden = output[0, -1]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(active, e)
        finally:
            if self._wake is not None:
                self._wake.set()

    async def _prefill(self, active: _Active) -> torch.Tensor:
        stream = active.stream
        prompt = stream.prompt_ids
        needed = len(prompt) + stream.params.max_tokens
        kept = self._idle.take(prompt, needed, time.monotonic(), active.owner)
        self.metrics.idle_sessions.set(len(self._idle))
        if kept is None:
            return await self._open(active, prompt, needed)
        session, reused = kept
        session.rollback(reused)
        stream.cached_tokens = reused
        self.metrics.prefix_reuse_hits.inc()
        self.metrics.reused_tokens.inc(reused)
        logger.debug("continuing a kept session: %d of %d prompt tokens reused", reused, len(prompt))
        return await self._feed(active, session)

    async def _open(self, active: _Active, prompt: list[int], needed: int) -> torch.Tensor:
        """Open a session for `needed` tokens and prefill the prompt; returns the prefill's output (1, T, H).

        The servers' free cache is read live first. The session gets headroom for a follow-up turn only if every
        block has room for it besides the sessions other requests are opening now; while some block has no room
        even for `needed` tokens, kept sessions are given up, oldest first. If the servers still refuse the
        session (requests opened at the same time took the room), every kept session is given up and it is tried
        once more.
        """
        roomy = min(self.max_length, needed + self.config.session_headroom)
        length = needed
        if roomy > needed or len(self._idle):
            free = await self._capacity.free_cache()
            if self._capacity.fits(free, roomy + self._opening):
                length = roomy
            else:
                while not self._capacity.fits(free, needed) and await self._give_up_oldest():
                    free = await self._capacity.free_cache()
        self._opening += length
        try:
            session = self.model.open_session(length)
            try:
                return await self._feed(active, session)
            except AllocationFailed:
                if not len(self._idle):
                    raise
            active.session = active.stepper = None
            self._close_later(session, None)
            while await self._give_up_oldest():
                pass
            return await self._feed(active, self.model.open_session(needed))
        finally:
            self._opening -= length

    async def _give_up_oldest(self) -> bool:
        """Close a kept session (a server is full: the largest holder's oldest); False if none is kept."""
        victim = self._idle.give_up_one()
        if victim is None:
            return False
        logger.debug("a server is full: giving up a kept session")
        self.metrics.idle_sessions_closed.labels("server_full").inc()
        self.metrics.idle_sessions.set(len(self._idle))
        await self._close(victim)
        return True

    async def _feed(self, active: _Active, session: InferenceSession | None = None) -> torch.Tensor:
        """Send the choice's tokens its session lacks (with `session`: a session just opened or kept for it, which
        holds a prefix of them); returns the last block's output at the last of them (1, 1, H)."""
        if session is not None:
            active.session = session
            active.stepper = Stepper(session, self._embed, self.model.lm_logits, session.token_ids.shape[1])
        stepper, session = active.stepper, active.session
        assert stepper is not None and session is not None
        stepper.seen = session.token_ids.shape[1]  # what it holds: after a rewind, the tokens before the lie
        ids = active.stream.all_ids
        embeds = await self._loop.run_in_executor(self._head, self.head_pass.embed, ids[stepper.seen :])
        output = await stepper.feed_async(torch.tensor([ids], dtype=torch.long), embeds)
        self.metrics.tokens_sent.inc(embeds.shape[1])
        return output

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings (1, t, H) of token ids (1, t)."""
        return self.model.embed(input_ids=ids)

    async def _decode(self, active: _Active, embed: torch.Tensor) -> None:
        try:
            assert active.stepper is not None
            ids = torch.tensor([active.stream.all_ids], dtype=torch.long)
            output = await active.stepper.feed_async(ids, embed)  # (1, 1, H)
            took = time.monotonic() - active.launched
            self._step_time = (
                took
                if self._step_time is None
                else ((1 - STEP_TIME_SMOOTHING) * self._step_time + STEP_TIME_SMOOTHING * took)
            )
            self.metrics.tokens_sent.inc(1)
            active.hidden = output[0, -1]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(active, e)
        finally:
            if self._wake is not None:
                self._wake.set()

    # ------------------------------------------------------------------ client loop: the step
    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not any(a.hidden is not None for a in self._active.values()):
                self._wake.clear()
                await self._sleep()
                self._expire_idle()
                continue
            group = self._next_group()
            await self._gather(group)
            ready = [a for a in self._active.values() if a.hidden is not None and a.group == group]
            for a in [a for a in ready if _rewind_pending(a)]:  # a spot check convicted a server of its route
                ready.remove(a)
                a.hidden, a.decoding = None, False
                a.task = self._loop.create_task(self._beside(a, lambda a=a: self._checked(a, None)))
            if not ready:  # cancelled or rewinding meanwhile
                continue
            hidden = torch.stack([a.hidden for a in ready])  # (R, H)
            for a in ready:
                a.hidden, a.task = None, None
            try:
                results = await self._loop.run_in_executor(
                    self._head, self.head_pass, [a.stream for a in ready], hidden
                )
            except Exception as e:  # a bug outside the per-row retries: fail these streams, not the engine
                logger.exception("head pass failed")
                for a in ready:
                    self._fail(a, e)
                continue
            launched = time.monotonic()
            for a, (event, embed) in zip(ready, results):
                if a.done:  # cancelled during the head pass
                    continue
                if isinstance(event, BaseException):
                    self._fail(a, event)
                    continue
                if event.finish_reason is not None and _checks(a) is not None:
                    a.decoding = False
                    a.task = self._loop.create_task(self._beside(a, lambda a=a, event=event: self._checked(a, event)))
                elif not self._post(a, event):
                    continue
                elif event.finish_reason is not None:
                    self._finish(a)
                else:
                    a.decoding, a.launched = True, launched
                    a.task = self._loop.create_task(self._decode(a, embed))

    def _post(self, active: _Active, event: StreamEvent) -> bool:
        """Hand a token's event to the client; with spot checks, hold it until the checks covering it passed (and
        post those earlier ones they now let out). False if the stream failed: a token it sent was wrong."""
        checks = _checks(active)
        if checks is None:
            active.handle.post(event)
            return True
        try:
            active.held.add(event)
        except OutputRetracted as e:
            self._fail(active, e)
            return False
        for ready in active.held.release(released_tokens(checks, len(active.stream.prompt_ids))):
            active.handle.post(ready)
        return True

    async def _checked(self, active: _Active, last: StreamEvent | None) -> torch.Tensor | None:
        """Spot checks of the stream's session (api.rewinds). With its `last` event: wait (up to verify_wait) for the
        checks in flight, then post its events and finish, unless a check found a liar. With a liar found: generate
        again from where it began lying (the stream's next hidden state comes back for the head)."""
        session = active.session
        assert session is not None and session.checks is not None
        if last is not None:
            active.held.add(last)  # posted once the checks are done
            await session.checks.drain(session.config.verify_wait)
            if session.checks.rewind is None:
                for event in active.held.release(None, final=True):
                    active.handle.post(event)
                self._finish(active)
                return None
        self.metrics.rewinds.inc()
        return await rewind_choice(session, active.stream, active.held, self._in_head, lambda: self._feed(active))

    def _in_head(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        """Run fn(*args) on the head thread (a stream's text work)."""
        return self._loop.run_in_executor(self._head, fn, *args)

    async def _sleep(self) -> None:
        assert self._wake is not None
        expiry = self._idle.next_expiry()
        timeout = None if expiry is None else max(0.0, expiry - time.monotonic()) + 0.01
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _next_group(self) -> int:
        """The group to run a head pass for: of those with a stream ready, the one whose ready stream's step was
        launched earliest."""
        ready = [a for a in self._active.values() if a.hidden is not None]
        return min(ready, key=lambda a: a.launched).group

    async def _gather(self, group: int) -> None:
        """Wait for the group's decode steps in flight that are not overdue, so they join this head pass."""
        if self._step_time is None:
            return
        now = time.monotonic()
        patience = max(OVERDUE * self._step_time, MIN_PATIENCE)
        pending = {
            a.task: a.launched
            for a in self._active.values()
            if a.group == group
            and a.decoding
            and a.task is not None
            and not a.task.done()
            and now - a.launched < patience
        }
        if pending:
            deadline = max(pending.values()) + patience
            await asyncio.wait(pending, timeout=min(max(deadline - now, 0.0), MAX_GATHER_WAIT))

    def _expire_idle(self) -> None:
        for session in self._idle.expired(time.monotonic()):
            self._close_later(session, "expired")
        self.metrics.idle_sessions.set(len(self._idle))

    # ------------------------------------------------------------------ head thread
    # ------------------------------------------------------------------ shutdown
    async def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        streams = [*self._active.values(), *self._waiting]
        for active in streams:
            if active.task is not None:
                active.task.cancel()
            active.handle.post(StreamEvent(error=EngineClosed("the API is shutting down")))
        sessions = [a.session for a in streams if a.session is not None] + self._idle.drain()
        self._active.clear()
        self._waiting.clear()
        self.metrics.idle_sessions_closed.labels("shutdown").inc(len(sessions))
        await asyncio.gather(*(self._close(s) for s in sessions), *self._background, return_exceptions=True)


def _checks(active: _Active) -> SessionChecks | None:
    """The spot checks of the stream's session; None when they are off (or it has no session)."""
    return None if active.session is None else active.session.checks


def _rewind_pending(active: _Active) -> bool:
    checks = _checks(active)
    return checks is not None and checks.rewind is not None


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the API engine stopped: %r", task.exception(), exc_info=task.exception())
