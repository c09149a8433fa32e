"""Session churn: 1,000 sessions opened and abandoned in every way (closed properly, dropped, stalled past the
servers' short session timeout, run past max_length, opened and never stepped, stepped and left, refused mid-way,
cut mid-frame, left unread, left while waiting for cache), at most CONCURRENCY at a time against two real servers
whose cache is small enough that sessions queue for it, while two honest clients keep generating. Afterwards the
servers are alive, the honest outputs equal HF greedy, every server's free cache equals its total, no session is
open and each server holds exactly the file descriptors it held before.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from conftest import TestSwarm, start_named_servers
from corolla.protocol import PROTOCOL_VERSION
from fuzz_cases import H, Fuzzer, Target, Walk, bad_step, partial, randn, step_frame, valid_step
from hostile import HOSTILE_ARGS, SESSION_TIMEOUT, HonestClients, LoopNode, ServerWatch, idle_fds, log_problems
from raw_frames import tensor_frame

SEED = 1017
SESSIONS = 1000  # `slow`; the default run: 50
CONCURRENCY = 24
CACHE_TOKENS = 8192  # per server: a few stalled sessions of up to 2048 tokens fill it, and the others queue
MODES = ["close", "drop", "stall", "overflow", "never_step", "bad_step", "vanish_while_opening",
         "vanish_after_step", "mid_frame", "unread", "queue_and_vanish"]


@pytest.fixture(scope="module")
def churn_swarm(tiny_llama_path, tmp_path_factory):
    """Servers a (blocks 0:2) and b (2:4) with short timeouts and CACHE_TOKENS each, their log, a P2P node, their
    file descriptors at rest (hostile.idle_fds)."""
    log_path = tmp_path_factory.mktemp("logs") / "churn.log"
    args = [*HOSTILE_ARGS, "--cache-tokens", str(CACHE_TOKENS)]  # the later --cache-tokens wins
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("c"))}) as local:
        swarm = start_named_servers(local, tiny_llama_path, {"a": ["--blocks", "0:2", *args], "b": ["--blocks", "2:4", *args]})
        at_rest = idle_fds(swarm)
        node = LoopNode(swarm.peers)
        try:
            yield swarm, node, log_path, at_rest
        finally:
            node.close()


async def churn_session(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    """One session, opened and then abandoned in one of MODES."""
    mode = rng.choice(MODES)
    blocks = target.blocks(rng)
    batch, max_length = rng.randint(1, 2), rng.randint(16, 256)
    if mode in ("stall", "never_step", "queue_and_vanish"):  # big reservations, held a while or likely to wait
        max_length = rng.randint(256, 1024)
    walk = Walk(batch, max_length, blocks["end"] - blocks["start"])
    opened = {"ok:session_opened", "error:server_full"}  # the cache may stay full for the whole allocation wait
    async with fz.stream(target, "inference") as stream:
        await stream.write(tensor_frame({"kind": "open_session", "protocol_version": PROTOCOL_VERSION, "blocks": blocks, "batch_size": batch,
                                         "max_length": max_length, "alloc_timeout": rng.uniform(0, 1.5)}, {}))
        if mode in ("vanish_while_opening", "queue_and_vanish"):
            stream.abort() if rng.random() < 0.5 else stream.close()
            fz.dropped(f"churn/{mode}")
            return
        if (await fz.expect("churn/open", stream, opened))[0] != "ok:session_opened":
            return
        for _ in range(rng.randint(0 if mode in ("stall", "never_step") else 1, 4)):
            position, tensors, fields = valid_step(rng, walk)
            await stream.write(step_frame(walk.steps, position, tensors, **fields))
            walk.steps += 1
            if mode == "vanish_after_step":  # gone before the answer
                break
            if (await fz.expect("churn/step", stream, {"ok:step_result"}))[0] != "ok:step_result":
                return
            walk.held = position + tensors["hidden"].shape[1]
        case = f"churn/{mode}"
        if mode == "close":
            await stream.write(tensor_frame({"kind": "close_session"}, {}))
            fz.dropped(case)
        elif mode == "drop":
            stream.abort()
            fz.dropped(case)
        elif mode == "stall":
            await fz.expect(case, stream, {"error:timeout"})
        elif mode == "overflow":  # fill the session, then one token more
            position = min(walk.held, walk.max_length)
            if position < walk.max_length:
                await stream.write(step_frame(walk.steps, position, {"hidden": randn(rng, batch, walk.max_length - position, H)}))
                walk.steps += 1
                await fz.expect("churn/step", stream, {"ok:step_result"})
            await stream.write(step_frame(walk.steps, walk.max_length, {"hidden": randn(rng, batch, 1, H)}))
            await fz.expect(case, stream, {"error:session_full"})
        elif mode == "never_step":
            await asyncio.sleep(rng.uniform(0, 1))
            fz.dropped(case)
        elif mode == "bad_step":
            what, data, allowed = bad_step(rng, walk)
            await stream.write(data)
            await fz.expect(f"{case}/{what}", stream, allowed)
        elif mode == "mid_frame":
            position, tensors, fields = valid_step(rng, walk)
            await stream.write(partial(step_frame(walk.steps, position, tensors, **fields), rng))
            fz.dropped(case)
        elif mode == "unread":
            for _ in range(rng.randint(1, 4)):
                position, tensors, fields = valid_step(rng, walk)
                await stream.write(step_frame(walk.steps, position, tensors, **fields))
                walk.held = position + tensors["hidden"].shape[1]
            fz.dropped(case)
        else:  # vanish_after_step: the stream closes as the server answers
            fz.dropped(case)


@pytest.mark.parametrize("sessions", [50, pytest.param(SESSIONS, marks=pytest.mark.slow)])
def test_a_thousand_sessions_abandoned_in_every_way_leave_nothing_behind(churn_swarm, sessions):
    swarm, node, log_path, at_rest = churn_swarm
    clients = HonestClients(swarm.model_path, swarm.peers)
    try:
        watch = ServerWatch(swarm, node, at_rest)
        clients.check_once()
        churn = Fuzzer(node.p2p, [Target("a", swarm.peer_ids["a"], 0, 2), Target("b", swarm.peer_ids["b"], 2, 4)])
        clients.start()
        begin = time.monotonic()
        node.run(churn.run([churn_session], sessions, SEED, CONCURRENCY), timeout=900)
        elapsed = time.monotonic() - begin
        clients.stop()
        during = list(clients.generations)
        clients.check_once()
        problems = watch.wait_settled(timeout=3 * SESSION_TIMEOUT + 30)
        _report(churn, sessions, elapsed, during)

        for name, proc in swarm.procs.items():
            assert proc.alive(), f"server {name} died:\n{proc.tail()}"
        assert not churn.unexpected, f"{len(churn.unexpected)} unexpected answers:\n" + "\n".join(churn.unexpected[:40])
        assert churn.resets <= max(5, churn.streams // 50), f"{churn.resets} of {churn.streams} streams reset"
        assert not clients.failures, "\n".join(clients.failures[:20])
        assert all(n >= 1 for n in during), f"honest clients generated {during} times during the churn"
        assert not problems, f"servers did not let go of everything: {problems}"
        assert not log_problems(log_path.read_text()), "\n".join(log_problems(log_path.read_text())[:40])
    finally:
        clients.shutdown()


def _report(churn: Fuzzer, sessions: int, elapsed: float, generations: list[int]) -> None:
    modes = Counter()
    for key, n in churn.tally.items():
        if not key.startswith(("churn/open", "churn/step")):
            modes[key.split(" -> ")[0].split("/")[1]] += n
    opened = sum(n for key, n in churn.tally.items() if key == "churn/open -> ok:session_opened")
    full = sum(n for key, n in churn.tally.items() if key == "churn/open -> error:server_full")
    print(f"\nchurn: {sessions} sessions ({opened} opened, {full} refused server_full, the rest abandoned before the "
          f"answer), {churn.frames} frames, {churn.streams} streams ({churn.resets} reset before an answer) in "
          f"{elapsed:.1f}s; honest generations meanwhile {generations}; endings {dict(modes)}")
    for key, n in sorted(churn.tally.items()):
        print(f"  {n:5d}  {key}")
