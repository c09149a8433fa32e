"""Pure parts of the monitor and of server metrics, with exact numbers: coverage, ranges, rates, the judgement of
one model from records and pings, the page's embedding, and what each metrics seam records."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from corolla.monitor.collect import model_view, plan_reads
from corolla.monitor.config import MonitorConfig
from corolla.monitor.coverage import capacity, coverage_counts, format_ranges, missing_ranges, served_tokens_per_s
from corolla.monitor.history import History
from corolla.monitor.liveness import Liveness
from corolla.monitor.page import render_page
from corolla.monitor.prometheus import render, swarm_registry
from corolla.monitor.schema import SwarmState
from corolla.monitor.source import SwarmMonitor
from corolla.monitor.tracker import PeerTracker
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.messages import InfoReply, ServerInfo, ServerState
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.metrics import ServerMetrics, step_path


def make_info(start: int, end: int, state: ServerState = ServerState.ONLINE, throughput: float = 10.0, free: int = 100) -> ServerInfo:
    return ServerInfo(state=state, start_block=start, end_block=end, throughput=throughput, cache_tokens_total=100,
                      cache_tokens_free=free, torch_dtype="float32", version="0.1.0", protocol_version=PROTOCOL_VERSION,
                      max_session_length=1024)


def make_reply(peer: str, info: ServerInfo, prefix: str = "m", decode_steps: int = 0) -> InfoReply:
    return InfoReply(peer_id=peer, info=info, model=prefix, dht_prefix=prefix, hidden_size=64, active_sessions=0,
                     decode_steps=decode_steps)


def records(num_blocks: int, servers: dict[str, ServerInfo]) -> list[dict[str, ServerInfo]]:
    """Block records as the DHT holds them: each server's info under every block of its range."""
    return [{peer: info for peer, info in servers.items() if info.start_block <= b < info.end_block} for b in range(num_blocks)]


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


# ---------------------------------------------------------------- coverage arithmetic
def test_coverage_counts_overlapping_spans_and_clips_them_to_the_model():
    assert coverage_counts(6, [(0, 2), (1, 4), (5, 9), (-3, 1)]) == [2, 2, 1, 1, 0, 1]


@pytest.mark.parametrize("counts, ranges", [
    ([1, 1, 1], []), ([0, 0, 1, 0], [(0, 2), (3, 4)]), ([1, 1, 0, 0, 1, 1], [(2, 4)]), ([], []), ([0], [(0, 1)]),
])
def test_missing_ranges_are_maximal_half_open_runs(counts, ranges):
    assert missing_ranges(counts) == ranges


def test_ranges_print_in_the_notation_of_blocks():
    assert format_ranges([(2, 4), (7, 8)]) == ["2:4", "7:8"]


def test_capacity_is_the_weakest_blocks_summed_throughput():
    assert capacity(4, [(0, 2, 10.0), (0, 4, 5.0), (2, 4, 2.0)]) == 7.0
    assert capacity(4, [(0, 3, 10.0)]) == 0.0 and capacity(0, []) == 0.0


def test_served_tokens_count_each_token_once_however_the_chain_is_split():
    # 6 blocks served as 0:2, 2:4, 4:6, each seeing 12 decode steps/s: 12 tokens/s
    assert served_tokens_per_s(6, [(0, 2, 12.0), (2, 4, 12.0), (4, 6, 12.0)]) == pytest.approx(12.0)
    # one server holds everything: its steps are the tokens
    assert served_tokens_per_s(6, [(0, 6, 7.0)]) == pytest.approx(7.0)


# ---------------------------------------------------------------- tracker and history
def test_tracker_reports_uptime_and_rate_and_restarts_after_a_missed_ping():
    tracker = PeerTracker()
    assert tracker.observe("a", 100.0, True, 10) == (0.0, None)
    assert tracker.observe("a", 102.0, True, 30) == (2.0, 10.0)
    assert tracker.observe("a", 104.0, False, None) == (None, None)
    assert tracker.observe("a", 106.0, True, 50) == (0.0, None)
    assert tracker.observe("a", 107.0, True, 5) == (1.0, None)  # the counter went back: a restarted server
    tracker.retain(set())
    assert tracker.observe("a", 110.0, True, 5) == (0.0, None)


def test_history_keeps_only_the_last_samples():
    history = History(2)
    for t in (1.0, 2.0, 3.0):
        history.add(SwarmState(updated_at=t, refresh_period=1.0, monitor_peer_id="me", models=[]))
    assert [s.t for s in history.samples()] == [2.0, 3.0] and len(history) == 2


# ---------------------------------------------------------------- judging a model
def test_a_server_that_misses_its_ping_is_unreachable_and_its_blocks_missing():
    servers = {"a": make_info(0, 2), "b": make_info(2, 4), "c": make_info(4, 6)}
    liveness = {"a": Liveness(True, 0.002, make_reply("a", servers["a"]), relay=False),
                "b": Liveness(False, error="connection refused"),
                "c": Liveness(True, 0.004, make_reply("c", servers["c"]), relay=True)}
    view = model_view("m", "llama", 6, records(6, servers), liveness, PeerTracker(), now=50.0)
    assert view.coverage == [1, 1, 0, 0, 1, 1] and view.missing_ranges == ["2:4"] and view.uncovered_blocks == [2, 3]
    assert not view.healthy and view.servers_online == 2 and view.capacity == 0.0
    by_peer = {s.peer_id: s for s in view.servers}
    assert (by_peer["b"].state, by_peer["b"].announced_state, by_peer["b"].error) == ("unreachable", "online", "connection refused")
    assert (by_peer["a"].rtt_ms, by_peer["a"].reachability, by_peer["c"].reachability) == (2.0, "direct", "relay")
    assert [s.peer_id for s in view.servers] == ["a", "b", "c"]


def test_a_servers_own_answer_overrides_its_older_record():
    record = make_info(0, 4, free=100)
    live = make_info(0, 4, state=ServerState.OFFLINE, free=40)  # it is shutting down; the record does not say so yet
    view = model_view("m", "", 4, records(4, {"a": record}), {"a": Liveness(True, 0.001, make_reply("a", live))}, PeerTracker(), 1.0)
    [server] = view.servers
    assert (server.state, server.announced_state, server.cache_tokens_free) == ("offline", "online", 40)
    assert view.missing_ranges == ["0:4"]


def test_an_answer_about_another_model_does_not_override_the_record():
    record = make_info(0, 4)
    other = make_reply("a", make_info(0, 1, state=ServerState.OFFLINE), prefix="other-model")
    view = model_view("m", "", 4, records(4, {"a": record}), {"a": Liveness(True, 0.001, other)}, PeerTracker(), 1.0)
    assert view.healthy and view.servers[0].active_sessions is None


def test_a_server_that_moved_is_judged_by_its_online_record():
    per_block = records(4, {"a": make_info(0, 2, state=ServerState.OFFLINE)})
    for by_peer in per_block[2:]:
        by_peer["a"] = make_info(2, 4)
    view = model_view("m", "", 4, per_block, {"a": Liveness(True, 0.001)}, PeerTracker(), 1.0)
    assert view.coverage == [0, 0, 1, 1] and (view.servers[0].start_block, view.servers[0].state) == (2, "online")


def test_tokens_per_second_come_from_decode_counters_between_refreshes():
    servers = {"a": make_info(0, 2), "b": make_info(2, 4)}
    tracker = PeerTracker()
    first = {p: Liveness(True, 0.001, make_reply(p, i, decode_steps=100)) for p, i in servers.items()}
    assert model_view("m", "", 4, records(4, servers), first, tracker, 10.0).tokens_per_s is None
    second = {p: Liveness(True, 0.001, make_reply(p, i, decode_steps=120)) for p, i in servers.items()}
    view = model_view("m", "", 4, records(4, servers), second, tracker, 12.0)
    assert view.tokens_per_s == pytest.approx(10.0) and view.servers[0].uptime_s == 2.0


# ---------------------------------------------------------------- the page and the monitor's metrics
def test_the_page_embeds_state_that_cannot_end_its_script_early():
    state = SwarmState(updated_at=1.0, refresh_period=2.0, monitor_peer_id="</script><b>x", models=[])
    html = render_page(state, state_url="/api/v1/state", refresh_period=2.0)
    assert "</script><b>x" not in html and "\\u003c/script\\u003e\\u003cb\\u003ex" in html
    assert '"chat_url": null' in html and '"refresh_ms": 2000' in html
    chat = render_page(None, state_url="/s", refresh_period=1.0, chat_url="/v1/chat/completions")
    assert '"chat_url": "/v1/chat/completions"' in chat and '"models_url": "/v1/models"' in chat


@pytest.mark.parametrize("announced", ["<!--<script>", "</script><script>alert(1)</script>", "a&amp;b", "x\u2028y\u2029z"])
def test_announced_strings_cannot_change_how_the_page_parses(announced):
    """A model_type or adapter name is whatever a server announced: "<!--<script>" inside the embedded JSON would
    make the HTML parser swallow the page's own script. The embedded JSON holds none of <, >, &, U+2028, U+2029 and
    still reads back exactly."""
    view = model_view("m", announced, 2, records(2, {"p": make_info(0, 2)}), {"p": Liveness(True, rtt=0.01)},
                      PeerTracker(), now=1.0)
    state = SwarmState(updated_at=1.0, refresh_period=2.0, monitor_peer_id="me", models=[view])
    html = render_page(state, state_url="/api/v1/state", refresh_period=2.0)
    opening = '<script type="application/json" id="page-config">'
    embedded = html[html.index(opening) + len(opening):]
    embedded = embedded[: embedded.index("</script>")]
    assert not any(c in embedded for c in "<>&\u2028\u2029")
    assert json.loads(embedded)["initial_state"]["models"][0]["model_type"] == announced
    assert html.count("<script") == 2 and html.index('"use strict"') > html.index(opening)  # the app's script follows


def test_reads_go_to_live_then_most_announced_models_within_the_key_budget():
    num_keys = {"real": 6, "seen": 32, "fake-a": 4096, "fake-b": 8, "fake-c": 8, "other": 600}
    priority = {"fake-a": 5, "fake-b": 4, "fake-c": 4, "real": 3, "other": 2}
    assert plan_reads(num_keys, priority, {"seen"}, 1024) == [
        ("seen", 32), ("fake-b", 8), ("fake-c", 8), ("real", 6), ("other", 600)]
    assert plan_reads(num_keys, priority, {"seen"}, 50) == [("seen", 32), ("fake-b", 8), ("fake-c", 8)]
    assert plan_reads({"m": 0}, {}, set(), 10) == []


def test_monitor_metrics_follow_the_latest_state_and_drop_expired_servers():
    monitor = SwarmMonitor(node=None, config=MonitorConfig(initial_peers=("x",)))  # type: ignore[arg-type]
    registry = swarm_registry(monitor)
    assert samples(render(registry))[("corolla_monitor_refreshes_total", ())] == 0
    servers = {"a": make_info(0, 2), "b": make_info(2, 4)}
    liveness = {p: Liveness(True, 0.003, make_reply(p, i, decode_steps=7)) for p, i in servers.items()}
    view = model_view("m", "llama", 4, records(4, servers), liveness, PeerTracker(), 1.0)
    monitor.latest = SwarmState(updated_at=1.0, refresh_period=1.0, monitor_peer_id="me", models=[view])
    got = samples(render(registry))
    assert got[("corolla_swarm_blocks_covered", (("model", "m"),))] == 4
    assert got[("corolla_swarm_server_decode_steps_total", (("model", "m"), ("peer_id", "a")))] == 7
    assert got[("corolla_swarm_server_rtt_seconds", (("model", "m"), ("peer_id", "b")))] == pytest.approx(0.003)
    only_a = model_view("m", "llama", 4, records(4, {"a": servers["a"]}), liveness, PeerTracker(), 2.0)
    monitor.latest = SwarmState(updated_at=2.0, refresh_period=1.0, monitor_peer_id="me", models=[only_a])
    got = samples(render(registry))
    assert ("corolla_swarm_server_up", (("model", "m"), ("peer_id", "b"))) not in got
    assert got[("corolla_swarm_healthy", (("model", "m"),))] == 0


# ---------------------------------------------------------------- server metrics seams
def test_step_paths_are_told_apart_through_adapter_wrappers():
    def decode_batch(items): ...
    def padded_step(*args): ...
    def allocate_cache(*args): ...

    bound = AdapterCalls(()).bind(decode_batch, "some-adapter")
    assert bound is not decode_batch and step_path(bound) == "decode"
    assert step_path(padded_step) == "padded" and step_path(allocate_cache) is None
    assert step_path(functools.partial(decode_batch)) is None  # a partial hides the name: not a step


def test_compute_worker_reports_each_call_and_survives_a_failing_observer():
    calls: list[tuple[str, int, int]] = []

    def observe(fn, batch_size, latencies):
        calls.append((fn.__name__, batch_size, len(latencies)))
        if fn.__name__ == "explode":
            raise RuntimeError("observer bug")

    def decode_batch(items):
        return [x * 2 for x in items]

    def explode():
        return "fine"

    async def main():
        worker = ComputeWorker(observe=observe)
        try:
            assert await worker.run(0, explode) == "fine"
            assert await asyncio.gather(*(worker.run_batched(0, decode_batch, "k", i) for i in range(3))) == [0, 2, 4]
        finally:
            worker.shutdown()

    asyncio.run(main())
    assert calls[0] == ("explode", 1, 1) and sum(n for name, n, _ in calls if name == "decode_batch") == 3


def test_server_metrics_record_steps_batches_reservations_and_cache_gauges():
    metrics = ServerMetrics()

    def decode_batch(items): ...
    def inference_step(*args): ...

    metrics.observe_compute(decode_batch, 3, [0.001, 0.002, 0.003])
    metrics.observe_compute(inference_step, 1, [0.02])

    async def reservations(allocator: CacheAllocator) -> None:
        assert await allocator.reserve("s1", 60, 0)
        assert not await allocator.reserve("s2", 60, 0.01)
        assert not await allocator.reserve("s3", 500, 1)

    allocator = CacheAllocator(100, metrics)
    metrics.watch(lambda: 1, lambda: allocator.budget)
    asyncio.run(reservations(allocator))
    got = samples(generate_latest(metrics.registry))
    assert got[("corolla_server_decode_batch_size_count", ())] == 1 and got[("corolla_server_decode_batch_size_sum", ())] == 3
    assert got[("corolla_server_step_seconds_count", (("path", "decode"),))] == 3
    assert got[("corolla_server_step_seconds_count", (("path", "merged"),))] == 1
    assert [got[("corolla_server_cache_reservations_total", (("result", r),))] for r in ("granted", "timeout", "too_large")] == [1, 1, 1]
    assert (got[("corolla_server_cache_tokens_used", ())], got[("corolla_server_cache_tokens_free", ())]) == (60, 40)
    assert got[("corolla_server_sessions_open", ())] == 1


def test_stream_counting_counts_bytes_both_ways_and_errors_by_code():
    metrics = ServerMetrics()

    class Sink:
        def __init__(self):
            self.data = b""
            self.closed = False

        def write(self, data):
            self.data += data

        def close(self):
            self.closed = True

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(b"0123456789")
        sink = Sink()
        counted_reader, counted_writer = metrics.count_stream("info", reader, sink)
        assert await counted_reader.readexactly(4) == b"0123" and await counted_reader.read(3) == b"456"
        counted_writer.write(b"abcde")
        counted_writer.close()  # delegated to the wrapped writer
        return sink

    sink = asyncio.run(main())
    metrics.observe_error("info", "bad_request")
    got = samples(generate_latest(metrics.registry))
    assert sink.data == b"abcde" and sink.closed
    assert got[("corolla_server_requests_total", (("rpc", "info"),))] == 1
    assert got[("corolla_server_bytes_received_total", (("rpc", "info"),))] == 7
    assert got[("corolla_server_bytes_sent_total", (("rpc", "info"),))] == 5
    assert got[("corolla_server_errors_total", (("code", "bad_request"), ("rpc", "info")))] == 1


def test_the_metrics_exporter_serves_its_registry_and_stops():
    metrics = ServerMetrics()
    port = metrics.start_http("127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert ("corolla_server_sessions_open", ()) in samples(text)
    finally:
        metrics.stop_http()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)


def test_the_metrics_exporter_on_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(ValueError, match="cannot serve metrics on 127.0.0.1"):
            ServerMetrics().start_http("127.0.0.1", taken.getsockname()[1])


def test_every_step_path_names_a_real_compute_function():
    """The metrics tell paths apart by function name: renaming one of these must fail here, not go unmeasured."""
    from corolla.server.compute import padding
    from corolla.server.compute.block_stack import BlockStack
    from corolla.server.metrics import STEP_PATHS

    for name in STEP_PATHS:
        assert callable(getattr(BlockStack, name, None) or getattr(padding, name, None)), name
