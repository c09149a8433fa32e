"""MonitorThread: a monitor on a DHT node and an event loop of its own (what `corolla api` runs, so that reading the
swarm never runs on the loop that drives inference): it refreshes while the caller's loop is busy, and stops."""

from __future__ import annotations

import asyncio
import threading
import time

from corolla.dht import ModelRecord, announce_blocks, create_swarm_node
from corolla.monitor.config import MonitorConfig
from corolla.monitor.source import MonitorThread
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.messages import ServerInfo, ServerState


def test_a_monitor_thread_refreshes_on_its_own_loop_and_stops():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731
    boot = run(create_swarm_node())
    peers = run(boot.maddrs())
    info = ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0, cache_tokens_total=1,
                      cache_tokens_free=1, torch_dtype="float32", version="t", protocol_version=PROTOCOL_VERSION,
                      max_session_length=8)
    assert run(announce_blocks(boot.dht, "watched", boot.peer_id, info, 300, ModelRecord(num_blocks=2)))
    monitor_thread = MonitorThread(peers, MonitorConfig(initial_peers=tuple(peers), refresh_period=0.25))
    try:
        monitor = monitor_thread.start()
        assert [m.dht_prefix for m in monitor.current().models] == ["watched"]
        before = monitor.refreshes
        time.sleep(2.0)  # this thread is busy doing nothing else; the monitor's own loop refreshes meanwhile
        assert monitor.refreshes >= before + 3
        assert monitor.node.peer_id != boot.peer_id
    finally:
        monitor_thread.stop()
        run(boot.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert not monitor_thread._thread.is_alive() and monitor_thread.monitor is None
