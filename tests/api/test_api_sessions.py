"""Kept sessions (prefix reuse) and the free-cache check: pure bookkeeping, exact answers."""

from __future__ import annotations

from corolla.api.capacity import has_room
from corolla.api.quota import StreamQuota
from corolla.api.sessions import IdleSessions, common_prefix
from corolla.protocol.messages import ServerInfo, ServerState


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_take_picks_the_longest_shared_prefix_and_keeps_one_token_to_compute():
    pool: IdleSessions[str] = IdleSessions(max_count=4, ttl=60, min_reuse=2)
    pool.put("short", [1, 2, 3], capacity=100, now=0)
    pool.put("long", [1, 2, 3, 4, 5, 6], capacity=100, now=1)
    pool.put("other", [9, 9, 9, 9, 9, 9, 9], capacity=100, now=2)
    assert pool.take([1, 2, 3, 4, 5, 7, 8], length=20, now=3) == ("long", 5)
    assert pool.take([1, 2, 3], length=20, now=3) == ("short", 2)  # the whole prompt held: resend its last token
    assert len(pool) == 1


def test_take_skips_sessions_too_short_too_old_or_sharing_too_little():
    pool: IdleSessions[str] = IdleSessions(max_count=4, ttl=10, min_reuse=3)
    pool.put("small", [1, 2, 3, 4], capacity=8, now=0)
    assert pool.take([1, 2, 3, 4, 5], length=9, now=1) is None  # cannot hold prompt + completion
    assert pool.take([1, 2, 7], length=5, now=1) is None  # 2 < min_reuse
    assert pool.take([1, 2, 3, 4, 5], length=8, now=11) is None  # expired
    assert pool.take([1, 2, 3, 4, 5], length=8, now=5) == ("small", 4)


def test_put_beyond_the_count_gives_up_the_oldest_and_zero_keeps_nothing():
    pool: IdleSessions[str] = IdleSessions(max_count=2, ttl=60, min_reuse=1)
    assert pool.put("a", [1], 10, now=0) == []
    assert pool.put("b", [2], 10, now=1) == []
    assert pool.put("c", [3], 10, now=2) == ["a"]
    assert pool.give_up_one() == "b" and pool.drain() == ["c"] and pool.give_up_one() is None
    none: IdleSessions[str] = IdleSessions(max_count=0, ttl=60, min_reuse=1)
    assert none.put("x", [1], 10, now=0) == ["x"] and len(none) == 0


def test_expired_and_next_expiry():
    pool: IdleSessions[str] = IdleSessions(max_count=4, ttl=10, min_reuse=1)
    assert pool.next_expiry() is None
    pool.put("a", [1], 10, now=0)
    pool.put("b", [2], 10, now=5)
    assert pool.next_expiry() == 10
    assert pool.expired(now=12) == ["a"] and len(pool) == 1


def info(start: int, end: int, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(state=state, start_block=start, end_block=end, throughput=1.0, cache_tokens_total=1000,
                      cache_tokens_free=1000, torch_dtype="float32", version="0", protocol_version=1,
                      max_session_length=1000)


def test_room_needs_one_server_with_enough_free_cache_for_every_block():
    a, b, c = info(0, 2), info(2, 4), info(0, 4)
    blocks = [{"A": a, "C": c}, {"A": a, "C": c}, {"B": b, "C": c}, {"B": b, "C": c}]
    assert has_room(blocks, {"A": 500, "B": 500, "C": 0}, 400)
    assert not has_room(blocks, {"A": 500, "B": 300, "C": 100}, 400)  # blocks 2-3: B and C both short
    assert has_room(blocks, {"A": 100, "B": 100, "C": 400}, 400)  # C covers everything
    assert has_room(blocks, {"A": 500}, 400)  # nobody answered for blocks 2-3: evicting would not help


def test_room_ignores_servers_that_are_not_online():
    blocks = [{"A": info(0, 1, ServerState.OFFLINE), "B": info(0, 1)}]
    assert not has_room(blocks, {"A": 900, "B": 10}, 400)


def test_a_prompt_only_continues_its_own_owners_sessions():
    pool: IdleSessions[str] = IdleSessions(max_count=4, ttl=60, min_reuse=2)
    pool.put("a's", [1, 2, 3, 4, 5], capacity=100, now=0, owner="key-a")
    assert pool.take([1, 2, 3, 4, 5, 6], length=20, now=1, owner="key-b") is None  # same prefix, other key
    assert pool.take([1, 2, 3, 4, 5, 6], length=20, now=1) is None  # nor the keyless owner
    assert pool.take([1, 2, 3, 4, 5, 6], length=20, now=1, owner="key-a") == ("a's", 5)


def test_the_owner_holding_the_most_gives_up_its_own_sessions_first():
    pool: IdleSessions[str] = IdleSessions(max_count=3, ttl=60, min_reuse=1)
    assert pool.put("a1", [1], 10, now=0, owner="a") == []
    given_up = [s for i in range(6) for s in pool.put(f"b{i}", [2], 10, now=1 + i, owner="b")]
    assert given_up == ["b0", "b1", "b2", "b3"]  # b floods the pool: a keeps its one session
    assert pool.held_by("a") == 1 and pool.held_by("b") == 2
    assert pool.give_up_one() == "b4"  # a server is full: the largest holder's oldest
    assert pool.give_up_one() == "a1"  # a tie: the oldest
    assert pool.put("a2", [1], 10, now=9, owner="a") == [] and pool.put("c1", [3], 10, now=10, owner="c") == []
    assert pool.put("c2", [3], 10, now=11, owner="c") == ["c1"]  # c now holds the most: its own oldest goes


def test_stream_quota_counts_per_owner_all_or_nothing():
    quota = StreamQuota(3)
    assert quota.take("a", 2) and not quota.take("a", 2) and quota.take("a", 1) and not quota.take("a", 1)
    assert quota.take("b", 3)  # another owner has its own limit
    quota.give_back("a", 2)
    assert quota.held("a") == 1 and quota.take("a", 2)
    unlimited = StreamQuota(None)
    assert unlimited.take("", 10_000)
