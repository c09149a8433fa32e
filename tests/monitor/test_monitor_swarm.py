"""`corolla monitor`, `corolla status` and `corolla serve --metrics-port` against a real swarm: the contract's URL
line and routes, the JSON naming every server, Prometheus text that prometheus_client parses, and counters that
move when a session runs."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
import torch

from conftest import TestSwarm, make_llama_checkpoint, run_corolla, start_named_servers
from corolla import AutoDistributedModelForCausalLM
from corolla.client.swarm.connection import Connection
from corolla.dht import create_swarm_node
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import RemoteError
from corolla.protocol.messages import BlockRange, OpenSession
from monitor_helpers import SIX_BLOCKS, free_port, get_json, http_get, running_monitor, scrape, stop_group, value, wait_for

MODEL = "tiny6"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    """Two servers (0:3 with --metrics-port, 3:6) of a 6-block tiny Llama, and a monitor refreshing every second."""
    path = str(make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, **SIX_BLOCKS))
    metrics_port = free_port()
    log_path = tmp_path_factory.mktemp("logs") / "monitor-swarm.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        named = start_named_servers(local, path, {
            "first": ["--blocks", "0:3", "--metrics-port", str(metrics_port)], "second": ["--blocks", "3:6"],
        })
        with running_monitor(named.peers, "--refresh-period", "1") as monitor:
            yield dict(path=path, peers=named.peers, peer_ids=named.peer_ids, monitor=monitor,
                       server_metrics=f"http://127.0.0.1:{metrics_port}/metrics")


def test_monitor_logs_its_url_and_serves_the_page_the_state_and_metrics(swarm):
    monitor = swarm["monitor"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", monitor.url) and not monitor.url.endswith(":0")
    status, content_type, html = http_get(monitor.url + "/")
    assert status == 200 and content_type.startswith("text/html")
    assert all(peer in html for peer in swarm["peer_ids"].values())  # the current state is embedded in the page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the page must not load anything from elsewhere"

    state = get_json(monitor.url + "/api/v1/state")
    [model] = state["models"]
    assert (model["dht_prefix"], model["model_type"], model["num_blocks"]) == (MODEL, "llama", 6)
    assert model["healthy"] and model["coverage"] == [1] * 6 and model["missing_ranges"] == []
    servers = {s["peer_id"]: s for s in model["servers"]}
    assert set(servers) == set(swarm["peer_ids"].values())
    first = servers[swarm["peer_ids"]["first"]]
    assert (first["start_block"], first["end_block"], first["state"], first["reachable"]) == (0, 3, "online", True)
    assert first["rtt_ms"] > 0 and first["reachability"] == "direct" and first["cache_tokens_free"] > 0
    assert state["history"] and state["history"][-1]["models"][MODEL]["coverage"] == 1.0
    assert "ServerView" in get_json(monitor.url + "/api/openapi.json")["components"]["schemas"]  # the documented shape

    samples = scrape(monitor.url + "/metrics")
    assert value(samples, "corolla_swarm_blocks", model=MODEL) == 6
    assert value(samples, "corolla_swarm_blocks_covered", model=MODEL) == 6
    assert value(samples, "corolla_swarm_healthy", model=MODEL) == 1
    assert value(samples, "corolla_swarm_servers", model=MODEL, state="online") == 2
    for peer in swarm["peer_ids"].values():
        assert value(samples, "corolla_swarm_server_up", model=MODEL, peer_id=peer) == 1
    assert value(samples, "corolla_monitor_refreshes_total") >= 1


def test_a_session_moves_the_server_and_monitor_counters(swarm):
    first = swarm["peer_ids"]["first"]
    decode_steps = lambda: value(scrape(swarm["monitor"].url + "/metrics"), "corolla_swarm_server_decode_steps_total",  # noqa: E731
                                 model=MODEL, peer_id=first)
    server_before, monitor_before = scrape(swarm["server_metrics"]), decode_steps()
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm["path"], initial_peers=swarm["peers"], torch_dtype=torch.float32)
    try:
        with model.inference_session(max_length=32) as session:
            model.generate(torch.tensor([[1, 5, 9, 3]]), max_new_tokens=6, session=session)
    finally:
        model.shutdown()

    after = scrape(swarm["server_metrics"])
    moved = lambda name, **labels: value(after, name, **labels) - value(server_before, name, **labels)  # noqa: E731
    assert moved("corolla_server_requests_total", rpc="inference") >= 1
    assert moved("corolla_server_bytes_received_total", rpc="inference") > 0
    assert moved("corolla_server_bytes_sent_total", rpc="inference") > 0
    assert moved("corolla_server_step_seconds_count", path="decode") >= 5  # one per generated token after the first
    assert moved("corolla_server_step_seconds_count", path="merged") >= 1  # the prompt
    assert moved("corolla_server_decode_batch_size_count") >= 5
    assert moved("corolla_server_cache_reservations_total", result="granted") >= 1
    [info] = [dict(labels) for name, labels in after if name == "corolla_server_info"]
    assert info | {"peer_id": first, "model": MODEL, "blocks": "0:3", "dtype": "float32", "quant": "none"} == info
    # the session is closed: the gauges read at scrape time return to idle
    def idle_samples():
        samples = scrape(swarm["server_metrics"])
        return samples if value(samples, "corolla_server_sessions_open") == 0 else None

    idle = wait_for(idle_samples, 30)
    assert value(idle, "corolla_server_cache_tokens_used") == 0
    assert value(idle, "corolla_server_cache_tokens_free") == value(idle, "corolla_server_cache_tokens_total") > 0
    # the monitor sees the server's decode counter move at its next refresh
    assert wait_for(lambda: decode_steps() >= monitor_before + 5, 30)


def test_an_error_reply_is_counted_by_rpc_and_code(swarm):
    before = value(scrape(swarm["server_metrics"]), "corolla_server_errors_total", rpc="inference", code="not_served")

    async def ask_for_blocks_it_does_not_hold() -> None:
        node = await create_swarm_node(swarm["peers"], client_mode=True)
        try:
            connection = await Connection.open(node.p2p, swarm["peer_ids"]["first"], "inference", 30)
            try:
                await connection.send(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=3, end=6), max_length=8))
                with pytest.raises(RemoteError, match="not_served"):
                    await connection.receive(30)
            finally:
                connection.close()
        finally:
            await node.shutdown()

    asyncio.run(ask_for_blocks_it_does_not_hold())
    after = value(scrape(swarm["server_metrics"]), "corolla_server_errors_total", rpc="inference", code="not_served")
    assert after == before + 1


def test_status_agrees_with_the_monitor(swarm):
    result = run_corolla("status", "--initial-peers", *swarm["peers"], "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    page = get_json(swarm["monitor"].url + "/api/v1/state?history=false")
    assert page["history"] == [] and "history" not in status
    judged = lambda state: [(m["dht_prefix"], m["coverage"], m["healthy"], [(s["peer_id"], s["state"], s["start_block"], s["end_block"])  # noqa: E731
                                                                              for s in m["servers"]]) for m in state["models"]]
    assert judged(status) == judged(page)


def test_status_of_one_model_keeps_its_json_shape(swarm):
    result = run_corolla("status", "--initial-peers", *swarm["peers"], "--model", swarm["path"], "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["dht_prefix"], report["num_blocks"], report["uncovered_blocks"]) == (MODEL, 6, [])
    assert sorted((s["start_block"], s["end_block"], s["state"]) for s in report["servers"]) == [(0, 3, "online"), (3, 6, "online")]


def test_monitor_stops_cleanly_on_sigterm(swarm):
    with running_monitor(swarm["peers"]) as monitor:
        assert get_json(monitor.url + "/api/v1/state")["models"]
        code = stop_group(monitor.popen)
    assert code == 0, monitor.tail()


def test_monitor_answers_help():
    result = run_corolla("monitor", "--help")
    assert result.returncode == 0 and "usage: corolla monitor" in result.stdout and "--initial-peers" in result.stdout


NOBODY = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWBA7wYAHDVUrcMHpb9gC9hmTiYxmUxNqhcTddmFBVLkDm"  # no DHT peer listens there


@pytest.mark.parametrize("args, code, message", [
    ([], 2, "--initial-peers"),
    (["--initial-peers", NOBODY, "--refresh-period", "0"], 2, "--refresh-period"),
    (["--initial-peers", NOBODY, "--port", "0"], 1, "could not reach any initial peer (" + NOBODY),
])
def test_monitor_refuses_bad_arguments_with_a_clear_error(args, code, message):
    """Bad flags are the user's to fix (exit 2); a swarm nobody answers for is the world's (exit 1, cli.errors)."""
    result = run_corolla("monitor", *args)
    assert result.returncode == code and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_monitor_on_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_corolla("monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmNotUsed", "--port", str(port))
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
