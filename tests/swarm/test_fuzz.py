"""Hostile input at scale: thousands of malformed, truncated, oversized, out-of-order and wrong-type frames and
messages thrown at two real servers' every RPC (fuzz_cases), while two honest clients keep generating. Afterwards
the servers are alive, the honest outputs equal HF greedy, every server's free cache equals its total, no session
is open, and each server holds exactly the file descriptors (one per open stream) it held before.

Below the fuzz, one focused test per server fix it led to.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import torch

from conftest import TestSwarm, wait_until
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import MAX_HEADER_BYTES, decode_frame
from fuzz_cases import CASES, Fuzzer, Target, burst
from hostile import (SESSION_TIMEOUT, HonestClients, LoopNode, ServerWatch, idle_fds, log_problems, start_hostile_swarm,
                     wait_push_streams_gone)
from raw_frames import RawStream, frame, open_fds, prefixed, tensor_frame

SEED = 17
CASE_COUNT = 2500  # cases drawn from fuzz_cases.CASES, each one to several frames (`slow`; the default run: 100)
BURSTS = 4  # of 20-60 streams opened at once each
CONCURRENCY = 32  # cases under way at once


@pytest.fixture(scope="module")
def hostile(tiny_llama_path, tmp_path_factory):
    """Servers a (blocks 0:2) and b (2:4) with short timeouts, their log file, a P2P node of the test's own, and
    the servers' file descriptors at rest (hostile.idle_fds)."""
    log_path = tmp_path_factory.mktemp("logs") / "hostile.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("c"))}) as local:
        swarm = start_hostile_swarm(local, tiny_llama_path)
        at_rest = idle_fds(swarm)
        node = LoopNode(swarm.peers)
        try:
            yield swarm, node, log_path, at_rest
        finally:
            node.close()


def targets(swarm) -> list[Target]:
    return [Target("a", swarm.peer_ids["a"], 0, 2), Target("b", swarm.peer_ids["b"], 2, 4)]


@pytest.mark.parametrize("case_count", [100, pytest.param(CASE_COUNT, marks=pytest.mark.slow)])
def test_servers_survive_thousands_of_hostile_frames_while_honest_clients_generate(hostile, case_count):
    swarm, node, log_path, at_rest = hostile
    clients = HonestClients(swarm.model_path, swarm.peers)
    try:
        watch = ServerWatch(swarm, node, at_rest)
        clients.check_once()
        fuzzer = Fuzzer(node.p2p, targets(swarm))
        clients.start()
        begin = time.monotonic()

        async def storm() -> None:
            await asyncio.gather(fuzzer.run(CASES, case_count, SEED, CONCURRENCY),
                                 fuzzer.run([burst], BURSTS, SEED + 1, BURSTS))

        node.run(storm(), timeout=900)
        elapsed = time.monotonic() - begin
        clients.stop()
        during = list(clients.generations)
        clients.check_once()  # after the storm, too
        problems = watch.wait_settled(timeout=3 * SESSION_TIMEOUT + 30)
        _report(fuzzer, case_count, elapsed, during)

        for name, proc in swarm.procs.items():
            assert proc.alive(), f"server {name} died:\n{proc.tail()}"
        assert not fuzzer.unexpected, f"{len(fuzzer.unexpected)} unexpected answers:\n" + "\n".join(fuzzer.unexpected[:40])
        assert fuzzer.resets <= max(5, fuzzer.streams // 50), f"{fuzzer.resets} of {fuzzer.streams} streams reset"
        assert not clients.failures, "\n".join(clients.failures[:20])
        assert all(n >= 1 for n in during), f"honest clients generated {during} times during the storm"
        assert not problems, f"servers did not let go of everything: {problems}"
        assert not log_problems(log_path.read_text()), "\n".join(log_problems(log_path.read_text())[:40])
    finally:
        clients.shutdown()


def _report(fuzzer: Fuzzer, case_count: int, elapsed: float, generations: list[int]) -> None:
    outcomes = Counter()
    for key, n in fuzzer.tally.items():
        outcomes[key.split(" -> ")[1]] += n
    print(f"\nfuzz: {case_count} cases + {BURSTS} bursts, {fuzzer.streams} streams ({fuzzer.resets} reset before an "
          f"answer), {fuzzer.frames} frames written in {elapsed:.1f}s; honest generations meanwhile {generations}; "
          f"answers {dict(outcomes)}")
    for key, n in sorted(fuzzer.tally.items()):
        print(f"  {n:5d}  {key}")


# ---------------------------------------------------------------- one test per fix the fuzz led to
def answer(node: LoopNode, peer: str, verb: str, data: bytes, wait: float = 30.0) -> tuple[str, dict]:
    """Send `data` on a new `verb` stream, return the answer (raw_frames.Outcome, message)."""

    async def go():
        stream = await RawStream.open(node.p2p, peer, verb)
        try:
            await stream.write(data)
            return await stream.answer(wait)
        finally:
            stream.close()

    return node.run(go())


FORWARD = {"kind": "forward", "protocol_version": PROTOCOL_VERSION, "blocks": {"start": 0, "end": 2}}


@pytest.mark.parametrize("shape", [[0, 1 << 62, 1 << 62], [True, 1, 64], [0, 1 << 63]])
def test_shapes_with_bool_or_huge_dimensions_are_bad_requests_not_internal_errors(hostile, shape):
    """torch overflowed computing strides of [0, 2^62, 2^62] (an empty tensor) and refused bools as sizes: both
    reached the client as `internal` errors."""
    swarm, node, _, at_rest = hostile
    outcome, msg = answer(node, swarm.peer_ids["a"], "forward",
                          frame({"v": PROTOCOL_VERSION, "msg": FORWARD, "tensors": [["hidden", "float32", shape]]}))
    assert outcome == "error:bad_request" and "bad shape" in msg["message"], msg


def test_a_frame_header_over_64_kib_is_refused_before_it_is_parsed(hostile):
    """msgpack turns one byte of header into up to ~70 bytes of Python objects (an array of empty arrays): a 1 GiB
    forward frame's header could take 70 GiB of the server's memory."""
    swarm, node, _, at_rest = hostile
    count = 4 << 20
    header = b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count  # an array of 4M empty arrays: 4 MiB, ~300 MB parsed
    outcome, msg = answer(node, swarm.peer_ids["a"], "forward", prefixed(len(header).to_bytes(4, "big") + header))
    assert outcome == "error:bad_request" and f"limit of {MAX_HEADER_BYTES} bytes" in msg["message"], msg
    with pytest.raises(ProtocolError, match="frame header of"):
        decode_frame((MAX_HEADER_BYTES + 1).to_bytes(4, "big") + bytes(MAX_HEADER_BYTES + 1))
    decode_frame(frame({"v": PROTOCOL_VERSION, "msg": {"kind": "info"}, "tensors": []})[8:])  # small headers still pass


def test_a_stream_that_never_says_anything_is_answered_within_the_session_timeout(hostile):
    """A silent new stream used to hold its task and socket for 30 s whatever the server's session timeout."""
    swarm, node, _, at_rest = hostile
    assert SESSION_TIMEOUT + 15 < 30
    outcome, _ = answer(node, swarm.peer_ids["b"], "inference", b"", wait=SESSION_TIMEOUT + 15)
    assert outcome == "error:timeout"


def test_a_session_refuses_a_frame_longer_than_any_of_its_steps_unread(hostile):
    """A session's frames are bounded by its batch x max_length, not by the 1 GiB frame limit: what its stream can
    make the server hold follows its cache reservation."""
    swarm, node, _, at_rest = hostile

    async def go():
        stream = await RawStream.open(node.p2p, swarm.peer_ids["a"], "inference")
        try:
            await stream.write(frame({"v": PROTOCOL_VERSION, "msg": {"kind": "open_session", "protocol_version": PROTOCOL_VERSION,
                                                      "blocks": {"start": 0, "end": 2}, "max_length": 8}, "tensors": []}))
            assert (await stream.answer(30))[0] == "ok:session_opened"
            await stream.write((1 << 20).to_bytes(8, "big"))  # 1 MiB announced for a (1, 8) session, none of it sent
            return await stream.answer(30)
        finally:
            stream.close()

    outcome, msg = node.run(go())
    assert outcome == "error:bad_request" and "exceeds the limit" in msg["message"], msg


def test_a_forward_over_more_tokens_than_the_session_limit_is_refused_before_computing(hostile):
    """A 60,000-token forward (15 MB) held the compute thread for minutes and grew the server to 7 GB."""
    swarm, node, _, at_rest = hostile
    outcome, msg = answer(node, swarm.peer_ids["a"], "forward", tensor_frame(FORWARD, {"hidden": torch.zeros(1, 1025, 64)}))
    assert outcome == "error:bad_request" and "limit of 1024 tokens" in msg["message"], msg


def test_a_client_that_never_reads_a_probe_reply_has_its_stream_aborted(hostile):
    """64 MiB asked for and never read: the server's write never finished, and closing would have waited to send
    it, so the stream, its task and the 64 MiB stayed as long as the client kept the stream open."""
    swarm, node, _, at_rest = hostile
    proc = swarm.procs["b"]
    wait_push_streams_gone(swarm, at_rest)  # the earlier tests' push stream into b is gone (see hostile's module doc)
    baseline = open_fds(proc.pid)

    async def ask() -> RawStream:
        stream = await RawStream.open(node.p2p, swarm.peer_ids["b"], "probe")
        await stream.write(tensor_frame({"kind": "probe", "reply_bytes": 64 << 20}, {"payload": torch.zeros(0, dtype=torch.int32)}))
        return stream

    streams = [node.run(ask()) for _ in range(3)]
    try:
        assert wait_until(lambda: open_fds(proc.pid) > baseline, timeout=10)
        assert wait_until(lambda: open_fds(proc.pid) == baseline, timeout=SESSION_TIMEOUT + 30), \
            f"{open_fds(proc.pid)} fds, {baseline} before: the unread streams are still held"
    finally:
        for stream in streams:
            node.loop.call_soon_threadsafe(stream.close)


def test_a_session_whose_client_never_reads_is_closed_and_its_cache_freed(hostile):
    """A client that sends steps but never reads their results: the server's write blocked forever, and with it the
    session, its cache reservation, and its idle timeout (which only runs while the server waits to read)."""
    swarm, node, _, at_rest = hostile
    watch = ServerWatch(swarm, node, at_rest)

    async def flood() -> RawStream:
        stream = await RawStream.open(node.p2p, swarm.peer_ids["a"], "inference")
        await stream.write(frame({"v": PROTOCOL_VERSION, "msg": {"kind": "open_session", "protocol_version": PROTOCOL_VERSION, "batch_size": 3,
                                                  "blocks": {"start": 0, "end": 2}, "max_length": 1024}, "tensors": []}))
        assert (await stream.answer(30))[0] == "ok:session_opened"
        step = tensor_frame({"kind": "inference_step", "step_id": 0, "position": 0}, {"hidden": torch.zeros(3, 1000, 64)})
        for _ in range(300):  # 768 kB of results each, never read; our writes stall once the server's do
            try:
                await asyncio.wait_for(stream.write(step), 2 * SESSION_TIMEOUT)
            except asyncio.TimeoutError:
                break
        return stream

    stream = node.run(flood())
    try:
        assert wait_until(lambda: watch.info("a").active_sessions == 0, timeout=SESSION_TIMEOUT + 30)
        info = watch.info("a").info
        assert info.cache_tokens_free == info.cache_tokens_total
    finally:
        node.loop.call_soon_threadsafe(stream.close)


def test_a_single_token_step_padded_in_every_row_passes_through(hostile):
    """Rows of different lengths whose one new slot is padding in every row: the ragged path was planned with no
    row to run and failed with an internal IndexError. Padded slots come out as they went in."""
    swarm, node, _, at_rest = hostile
    hidden = torch.randn(2, 1, 64)

    async def go():
        stream = await RawStream.open(node.p2p, swarm.peer_ids["b"], "inference")
        try:
            await stream.write(frame({"v": PROTOCOL_VERSION, "msg": {"kind": "open_session", "protocol_version": PROTOCOL_VERSION, "batch_size": 2,
                                                      "blocks": {"start": 2, "end": 4}, "max_length": 8}, "tensors": []}))
            assert (await stream.answer(30))[0] == "ok:session_opened"
            mask = torch.tensor([[False, True], [True, True]])  # the rows hold 1 and 2 tokens
            await stream.write(step(0, 0, torch.randn(2, 2, 64), mask))
            assert (await stream.answer(30))[0] == "ok:step_result"
            await stream.write(step(1, 2, hidden, torch.tensor([[False, True, False], [True, True, False]])))
            outcome, msg = await stream.answer(30)
            return outcome, msg, decode_frame(stream.last_payload)[1] if outcome == "ok:step_result" else None
        finally:
            stream.close()

    outcome, msg, tensors = node.run(go())
    assert outcome == "ok:step_result" and msg["position"] == 3, msg
    assert torch.equal(tensors["hidden"], hidden)


def step(step_id: int, position: int, hidden: torch.Tensor, mask: torch.Tensor) -> bytes:
    return tensor_frame({"kind": "inference_step", "step_id": step_id, "position": position},
                        {"hidden": hidden, "attention_mask": mask})
