"""rpc_push in process (the handler over in-memory streams, as test_handler.py drives it): a push frame from a peer
no session names is refused before it is read, a stream of pushes nobody accepts is ended, and a pushed step the
session cannot take goes to the owner as PushRefused with the pusher's receipt, leaving the session as it was."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.framing import decode_frame
from corolla.protocol.messages import (BlockRange, CloseSession, ErrorReply, InferenceStep, OpenSession, PushRefusal, PushRefused,
                                       PushSource, PushTarget, SessionOpened, StepResult)
from corolla.protocol.signing import PeerKey
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.rpc.handler import ConnectionHandler, _stream_adapter
from corolla.server.rpc.push_receiver import MAX_REFUSED_PUSHES, UNAUTHORIZED_PUSH_FRAME
from corolla.server.rpc.push import outgoing_push
from test_handler import HIDDEN, MemoryWriter, framed, stack  # noqa: F401 (fixture)

OWNER, PUSHER = PeerKey.generate(), PeerKey.generate()
SECRET = "5" * 32


def peer(key: PeerKey) -> SimpleNamespace:
    return SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: key.peer_id))


def serve(stack, scenario):
    worker = ComputeWorker()
    allocator = CacheAllocator(1024)
    handler = ConnectionHandler(stack, allocator, worker, ServerConfig(model="unused", session_timeout=5.0),
                                describe=lambda: None)

    async def run():
        tasks, readers = [], []

        def talk(verb: str, key: PeerKey):
            reader, writer = asyncio.StreamReader(), MemoryWriter()
            readers.append(reader)
            handler_fn = _stream_adapter(handler._handlers()[verb], verb, handler.metrics)
            tasks.append(asyncio.ensure_future(handler_fn(peer(key), reader, writer)))

            async def receive():
                return decode_frame(await writer.next_payload())

            return reader, writer, receive

        try:
            return await scenario(handler, talk)
        finally:
            for reader in readers:  # every peer hangs up: its streams end now, not after the session timeout
                reader.feed_eof()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

    try:
        result = asyncio.run(run())
    finally:
        worker.shutdown()
    assert allocator.budget.free == allocator.budget.total
    return result


async def open_pushed_session(talk):
    """The owner's session, accepting pushes from PUSHER over SECRET; returns its stream."""
    reader, writer, receive = talk("inference", OWNER)
    reader.feed_data(framed(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3),
                                        max_length=16, push_from=PushSource(peer_id=PUSHER.peer_id, secret=SECRET))))
    reply, _ = await receive()
    assert isinstance(reply, SessionOpened)
    return reader, receive


def push_frame(handler, key: PeerKey, hidden: torch.Tensor, position: int, step_id: int = 1, secret: str = SECRET) -> bytes:
    message, tensors = outgoing_push(key, PushTarget(peer_id=handler.key.peer_id, secret=secret), step_id, position,
                                     None, False, hidden, None)
    return framed(message, tensors)


def test_a_push_frame_from_a_peer_no_session_names_is_refused_before_it_is_read(stack):
    async def scenario(handler, talk):
        reader, writer, receive = talk("push", PUSHER)
        reader.feed_data((128 << 20).to_bytes(8, "big") + b"\0" * 1024)  # announces 128 MiB, sends 1 KiB
        reply, _ = await receive()
        reader.feed_eof()
        return reply

    reply = serve(stack, scenario)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert f"exceeds the limit of {UNAUTHORIZED_PUSH_FRAME} bytes" in reply.message


def test_a_stream_that_keeps_pushing_what_nobody_accepts_is_ended(stack):
    stranger = PeerKey.generate()

    async def scenario(handler, talk):
        owner_reader, _ = await open_pushed_session(talk)
        reader, writer, receive = talk("push", stranger)
        frame = push_frame(handler, stranger, torch.zeros(1, 1, HIDDEN), 0)  # even over the session's own link
        reader.feed_data(frame * (MAX_REFUSED_PUSHES + 3))
        replies = [(await receive())[0] for _ in range(MAX_REFUSED_PUSHES)]
        await asyncio.sleep(0.2)
        follow_up = len(writer.buffer)
        owner_reader.feed_data(framed(CloseSession()))
        reader.feed_eof()
        return replies, follow_up

    replies, follow_up = serve(stack, scenario)
    assert all(isinstance(r, ErrorReply) and "no open session here accepts pushes" in r.message for r in replies)
    assert "refused pushes in a row: the stream ends" in replies[-1].message
    assert follow_up == 0  # the frames after it were never read: the stream ended


def test_a_stale_push_from_a_named_peer_is_refused_and_its_shared_stream_goes_on(stack):
    async def scenario(handler, talk):
        owner_reader, owner_receive = await open_pushed_session(talk)
        reader, writer, receive = talk("push", PUSHER)
        # a push into a session that has gone (another link), then one into the live session, on the same stream
        reader.feed_data(push_frame(handler, PUSHER, torch.zeros(1, 1, HIDDEN), 0, secret="6" * 32))
        refused, _ = await receive()
        reader.feed_data(push_frame(handler, PUSHER, torch.randn(1, 2, HIDDEN), 0, step_id=3))
        result, _ = await owner_receive()
        owner_reader.feed_data(framed(CloseSession()))
        reader.feed_eof()
        return refused, result

    refused, result = serve(stack, scenario)
    assert isinstance(refused, ErrorReply) and "no open session here accepts pushes" in refused.message
    assert isinstance(result, StepResult) and result.step_id == 3


def test_a_pushed_step_the_session_cannot_take_is_refused_to_its_owner_with_the_receipt(stack):
    async def scenario(handler, talk):
        owner_reader, owner_receive = await open_pushed_session(talk)
        reader, writer, _ = talk("push", PUSHER)
        reader.feed_data(push_frame(handler, PUSHER, torch.full((1, 2, HIDDEN), float("nan")), 0, step_id=7))
        refused, _ = await owner_receive()
        reader.feed_data(push_frame(handler, PUSHER, torch.randn(1, 2, HIDDEN), 0, step_id=8))
        result, tensors = await owner_receive()
        owner_reader.feed_data(framed(InferenceStep(step_id=9, position=2), {"hidden": torch.randn(1, 1, HIDDEN)}))
        after, _ = await owner_receive()
        owner_reader.feed_data(framed(CloseSession()))
        reader.feed_eof()
        return refused, result, tensors, after

    refused, result, tensors, after = serve(stack, scenario)
    assert isinstance(refused, PushRefused) and refused.step_id == 7 and "NaN" in refused.reason
    assert refused.receipt.pusher == PUSHER.peer_id
    # the session went on: the good push ran at position 0, and the owner's own next step after it
    assert isinstance(result, StepResult) and (result.step_id, result.position) == (8, 2)
    assert result.receipt is not None and result.receipt.step_id == 8 and torch.isfinite(tensors["hidden"]).all()
    assert isinstance(after, StepResult) and after.position == 3


def test_a_push_with_a_receipt_not_matching_what_arrived_is_refused(stack):
    async def scenario(handler, talk):
        owner_reader, _ = await open_pushed_session(talk)
        reader, writer, receive = talk("push", PUSHER)
        message, tensors = outgoing_push(PUSHER, PushTarget(peer_id=handler.key.peer_id, secret=SECRET), 1, 0, None,
                                         False, torch.zeros(1, 1, HIDDEN), None)
        reader.feed_data(framed(message, {"hidden": torch.ones(1, 1, HIDDEN)}))  # signs zeros, sends ones
        reply, _ = await receive()
        owner_reader.feed_data(framed(CloseSession()))
        reader.feed_eof()
        return reply

    reply = serve(stack, scenario)
    assert isinstance(reply, ErrorReply) and "digest" in reply.message


def test_a_step_asking_for_its_last_positions_gets_only_those_back(stack):
    async def scenario(handler, talk):
        reader, writer, receive = talk("inference", OWNER)
        reader.feed_data(framed(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3),
                                            max_length=16)))
        assert isinstance((await receive())[0], SessionOpened)
        hidden = torch.randn(1, 5, HIDDEN)
        reader.feed_data(framed(InferenceStep(step_id=1, position=0, answer=1), {"hidden": hidden}))
        last, tensors = await receive()
        reader.feed_data(framed(InferenceStep(step_id=2, position=0), {"hidden": hidden}))
        _, whole = await receive()
        reader.feed_data(framed(CloseSession()))
        return last, tensors["hidden"], whole["hidden"]

    last, partial, whole = serve(stack, scenario)
    assert isinstance(last, StepResult) and last.position == 5
    # two computations of the same positions (the second rewrites the first's cache): equal up to rounding, which
    # differs with the number of torch threads
    assert partial.shape == (1, 1, HIDDEN) and torch.allclose(partial, whole[:, -1:], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- issue 34: refusals reach the owner, in order only
def test_a_push_the_receiver_refuses_is_told_to_the_owner_at_once_naming_the_cause_and_the_stream_goes_on(stack):
    """Attack 1's server half: a pusher that signs one output and pushes another (or forges its receipt) is refused,
    and the session's owner hears it at once on its own stream (PushRefused with the cause and the receipt as it
    arrived) instead of waiting out its request timeout; the push stream carries the next, good push."""

    async def scenario(handler, talk):
        owner_reader, owner_receive = await open_pushed_session(talk)
        reader, writer, receive = talk("push", PUSHER)
        message, tensors = outgoing_push(PUSHER, PushTarget(peer_id=handler.key.peer_id, secret=SECRET), 4, 0, None,
                                         False, torch.zeros(1, 2, HIDDEN), None)
        reader.feed_data(framed(message, {"hidden": torch.ones(1, 2, HIDDEN)}))  # signs zeros, sends ones
        digest = (await owner_receive())[0], (await receive())[0]
        forged = message.model_copy(update={"receipt": message.receipt.model_copy(update={"position": 1}),
                                            "position": 1})
        reader.feed_data(framed(forged, tensors))
        receipt = (await owner_receive())[0], (await receive())[0]
        reader.feed_data(push_frame(handler, PUSHER, torch.randn(1, 2, HIDDEN), 0, step_id=5))
        good, _ = await owner_receive()
        owner_reader.feed_data(framed(CloseSession()))
        reader.feed_eof()
        return digest, receipt, good

    (digest, to_pusher), (receipt, to_pusher_2), good = serve(stack, scenario)
    assert isinstance(digest, PushRefused) and digest.cause == PushRefusal.DIGEST and digest.step_id == 4
    assert digest.receipt.pusher == PUSHER.peer_id and "digest" in digest.reason
    assert isinstance(to_pusher, ErrorReply) and "digest" in to_pusher.message
    assert isinstance(receipt, PushRefused) and receipt.cause == PushRefusal.RECEIPT and "signature" in receipt.reason
    assert isinstance(to_pusher_2, ErrorReply)
    assert isinstance(good, StepResult) and (good.step_id, good.position) == (5, 2)


def test_an_upstream_server_cannot_rewrite_the_session_with_an_old_or_equal_step_id(stack):
    """Attack 2's server half: after step 6 ran, the upstream pushes positions 0..12 again as step 6 (equal) and as
    step 3 (older): both are refused as STALE to the owner, with the pusher's signed receipt, and the cache is
    untouched (the owner's next step sees what step 6 wrote)."""
    torch.manual_seed(3)
    prompt, rewrite, token = torch.randn(1, 4, HIDDEN), torch.randn(1, 13, HIDDEN), torch.randn(1, 1, HIDDEN)

    async def scenario(handler, talk):
        owner_reader, owner_receive = await open_pushed_session(talk)
        reader, writer, _ = talk("push", PUSHER)
        reader.feed_data(push_frame(handler, PUSHER, prompt, 0, step_id=6))
        first, _ = await owner_receive()
        refusals = []
        for step_id in (6, 3):
            reader.feed_data(push_frame(handler, PUSHER, rewrite, 0, step_id=step_id))
            refusals.append((await owner_receive())[0])
        owner_reader.feed_data(framed(InferenceStep(step_id=7, position=4), {"hidden": token}))
        after, tensors = await owner_receive()
        owner_reader.feed_data(framed(CloseSession()))
        reader.feed_eof()
        return first, refusals, after, tensors["hidden"]

    first, refusals, after, output = serve(stack, scenario)
    assert isinstance(first, StepResult) and first.position == 4
    assert all(isinstance(r, PushRefused) and r.cause == PushRefusal.STALE for r in refusals), refusals
    assert [r.step_id for r in refusals] == [6, 3] and all(r.receipt.pusher == PUSHER.peer_id for r in refusals)
    assert isinstance(after, StepResult) and after.position == 5
    cache = stack.allocate_cache(1, 16, 0, 3)
    stack.inference_step(prompt, cache, 0)
    torch.testing.assert_close(output, stack.inference_step(token, cache, 4), rtol=0, atol=1e-6)


def test_push_frames_in_flight_are_bounded_by_bytes_whatever_the_number_of_streams(stack):
    """Attack 6: the attacker's own session names the attacker as its push source, and 16 push streams each
    announce a frame as large as one step of it. What the server reads and holds of them is at most one step's
    frame for that session (the allowance): the others wait unread until it lets go, then are read in turn."""
    async def scenario(handler, talk):
        owner_reader, _ = await open_pushed_session(talk)
        receiver = handler.push_receiver
        allowance = receiver.allowance(PUSHER.peer_id)
        assert allowance == receiver.frame_limit(PUSHER.peer_id) > 10_000
        streams = [talk("push", PUSHER) for _ in range(16)]
        for reader, _, _ in streams:
            reader.feed_data(allowance.to_bytes(8, "big") + b"\0" * 4096)  # a whole step's frame, 4 KiB of it sent
        peak = 0
        for _ in range(50):
            await asyncio.sleep(0.01)
            peak = max(peak, receiver.budget.held[PUSHER.peer_id])
        waiting = len(receiver.running)  # nothing runs: the one frame read is incomplete
        for reader, _, _ in streams:
            reader.feed_eof()
        owner_reader.feed_data(framed(CloseSession()))
        return allowance, peak, waiting

    allowance, peak, running = serve(stack, scenario)
    assert peak == allowance  # one frame's worth held, the first stream's; the other 15 wait, unread
    assert running == 0
