"""Per-peer limits of a real `corolla serve` process, attacked by a hostile peer of the test's own over raw P2P streams
(corolla.testing.server_attacks), with an honest peer beside it. Each attack succeeded against the server before its
limit existed (measured: the honest session refused after 10 s; 8 unread probes of 64 MiB took the server from 483
to 2,019 MiB; a 512 MiB frame awaited and a 65,536-token forward computed; 400 sessions and 565 silent streams held by
one peer); here each must fail, the honest peer must be served, and the server must let go of everything afterwards.
"""

from __future__ import annotations


import pytest

from conftest import TestSwarm, start_named_servers, wait_until
from corolla.client.swarm.server_info import request_info
from corolla.dht.node import create_swarm_node
from corolla.server.presence.network import measure_peer
from corolla.testing.server_attacks import (
    cache_queue_attack,
    flood_attack,
    open_fds,
    pass_attack,
    probe_attack,
    process_rss_mib,
)
from hostile import LoopNode, log_problems

MAX_PEER_SESSIONS = 24  # the server's per-peer limits here: small, so that a flood past them is quick
MAX_PEER_STREAMS = 48
PROBE_STALL = 2.0  # seconds: --probe-stall-timeout
LIMIT_ARGS = ["--blocks", "0:4", "--cache-tokens", "32768", "--max-peer-sessions", str(MAX_PEER_SESSIONS),
              "--max-peer-streams", str(MAX_PEER_STREAMS), "--probe-stall-timeout", str(PROBE_STALL)]


@pytest.fixture(scope="module")
def limited(tiny_llama_path, tmp_path_factory):
    """One server (all 4 blocks) with small per-peer limits, its log, a hostile node and an honest node (one loop)."""
    log_path = tmp_path_factory.mktemp("logs") / "limits.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("c"))}) as local:
        swarm = start_named_servers(local, tiny_llama_path, {"server": LIMIT_ARGS})
        node = LoopNode(swarm.peers)
        honest = accomplice = None
        try:
            honest = node.run(create_swarm_node(swarm.peers, client_mode=True), timeout=120)
            accomplice = node.run(create_swarm_node(swarm.peers, client_mode=True), timeout=120)
            node.accomplice = accomplice  # the attacker's second identity
            yield swarm, node, honest, log_path
        finally:
            for other in (honest, accomplice):
                if other is not None:
                    node.run(other.shutdown(), timeout=60)
            node.close()


@pytest.fixture(autouse=True)
def server_lets_go_of_everything(limited):
    swarm, node, honest, log_path = limited
    proc = swarm.procs["server"]
    yield

    def settled() -> bool:
        info = node.run(request_info(honest.p2p, swarm.peer_ids["server"]), timeout=60)
        return info.active_sessions == 0 and info.info.cache_tokens_free == info.info.cache_tokens_total

    assert proc.alive(), f"the server died:\n{proc.tail()}"
    assert wait_until(settled, timeout=30, interval=0.5), "the attacker's sessions or cache were not let go of"
    assert not log_problems(log_path.read_text()), "\n".join(log_problems(log_path.read_text())[:20])


@pytest.mark.parametrize("queue_first", [False, True])
def test_an_honest_session_is_not_kept_waiting_behind_a_peer_queueing_for_the_whole_cache(limited, queue_first):
    """Attack 5 in its strongest form: two identities, one holding a token, the other queueing for the whole cache;
    the honest peer asks after the queue's patience (5 s) ran out, and is admitted at once, in either order (the
    token taken before the big request, or taken again after it and the first let go)."""
    swarm, node, honest, _ = limited
    result = node.run(cache_queue_attack(node.p2p, honest.p2p, swarm.peer_ids["server"], wait=10.0, after=6.0,
                                         queue_first=queue_first, accomplice=node.accomplice.p2p))
    assert not result.succeeded, result.details
    assert "ok:session_opened" in result.details


@pytest.mark.parametrize("reply_bytes", [64 << 20, 4 << 20])
def test_unread_probe_replies_neither_grow_the_server_nor_outlive_the_stall_timeout(limited, reply_bytes):
    swarm, node, honest, _ = limited
    proc = swarm.procs["server"]
    before = process_rss_mib(proc.pid)
    result = node.run(probe_attack(node.p2p, swarm.peer_ids["server"], proc.pid, probes=8, reply_bytes=reply_bytes,
                                   hold=PROBE_STALL + 3.0, rss_mib=64.0))
    assert not result.succeeded, result.details
    assert process_rss_mib(proc.pid) < before + 64, result.details
    bandwidth = node.run(measure_peer(honest.p2p, swarm.peer_ids["server"], repeats=1))  # 4 MiB each way, honest
    assert bandwidth > 0


def test_a_huge_forward_frame_is_refused_unread_and_a_forward_past_the_token_limit_is_not_computed(limited):
    swarm, node, _, _ = limited
    result = node.run(pass_attack(node.p2p, swarm.peer_ids["server"], rows=1024, length=64))
    assert not result.succeeded, result.details
    assert "exceeds the limit" in result.details


def test_a_flood_of_sessions_and_streams_from_one_peer_is_capped_while_an_honest_peer_is_served(limited):
    swarm, node, honest, _ = limited
    proc = swarm.procs["server"]
    baseline = open_fds(proc.pid)
    result = node.run(flood_attack(node.p2p, honest.p2p, swarm.peer_ids["server"], proc.pid,
                                   sessions=MAX_PEER_SESSIONS + 8, streams=2 * MAX_PEER_STREAMS,
                                   max_sessions=MAX_PEER_SESSIONS, max_streams=MAX_PEER_STREAMS))
    assert not result.succeeded, result.details
    assert f"sessions {MAX_PEER_SESSIONS} of" in result.details and "error:server_full" in result.details
    assert "error:peer_limit" in result.details
    # every stream of the flood is gone (a refused one lingers a second at most, an answered one a few)
    assert wait_until(lambda: open_fds(proc.pid) <= baseline + 2, timeout=30, interval=0.5), \
        f"{open_fds(proc.pid)} fds, {baseline} before the flood"


def test_rpc_info_names_the_model_without_the_servers_local_checkpoint_path(limited, tiny_llama_path):
    swarm, node, honest, _ = limited
    reply = node.run(request_info(honest.p2p, swarm.peer_ids["server"]))
    assert reply.model == "tiny-llama" and tiny_llama_path not in reply.model_dump_json()


def test_push_frames_a_session_names_itself_for_hold_one_steps_worth_whatever_the_number_of_streams(limited):
    """Attack 6: the attacker's own session (32 x 1,024 tokens: its whole cache share) names the attacker as its push
    source, and 16 push streams each send a frame as large as one step of it (~10 MB), never completing them. The
    server holds one such frame at a time (the others wait unread), not 16."""
    from corolla.testing.push_attacks import push_frame_flood

    swarm, node, honest, _ = limited
    proc = swarm.procs["server"]
    flood = node.run(push_frame_flood(node.node, swarm.peer_ids["server"], proc.pid, (0, 4), hidden_size=64,
                                      batch_size=32, max_length=1024, streams=16, hold=6.0))
    grown = flood.rss_peak - flood.rss_before
    frame_mib = flood.frame_bytes / 2**20
    assert grown < 2 * frame_mib + 16, f"{flood}: grew {grown:.0f} MiB for frames of {frame_mib:.0f} MiB"
    assert flood.sent >= flood.frame_bytes - 1  # the flood reached the server: one whole frame (but its last byte)
