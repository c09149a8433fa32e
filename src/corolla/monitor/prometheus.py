"""The monitor's `/metrics`: swarm-level Prometheus metrics, computed from the latest state at scrape time.

Every series is rebuilt from the latest state on each scrape, so a server whose record expired disappears from
the output instead of lingering with its last values. Labels: `model` (the DHT prefix), `peer_id`.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from corolla.monitor.source import SwarmMonitor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STATES = ("online", "joining", "offline", "unreachable")


class SwarmCollector:
    """A prometheus_client collector reading a SwarmMonitor."""

    def __init__(self, monitor: SwarmMonitor):
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        monitor = self.monitor
        yield CounterMetricFamily("corolla_monitor_refreshes", "Swarm refreshes completed", value=monitor.refreshes)
        yield CounterMetricFamily(
            "corolla_monitor_refresh_failures", "Swarm refreshes that failed", value=monitor.refresh_failures
        )
        yield GaugeMetricFamily(
            "corolla_monitor_refresh_seconds", "Duration of the last refresh", value=monitor.last_refresh_seconds
        )
        state = monitor.latest
        if state is None:
            return
        yield GaugeMetricFamily(
            "corolla_monitor_last_refresh_timestamp_seconds", "Unix time of the last refresh", value=state.updated_at
        )
        yield GaugeMetricFamily("corolla_swarm_models", "Models announced in the swarm", value=len(state.models))
        model = ["model"]
        blocks = GaugeMetricFamily("corolla_swarm_blocks", "Transformer blocks of the model", labels=model)
        covered = GaugeMetricFamily(
            "corolla_swarm_blocks_covered", "Blocks with at least one online server", labels=model
        )
        replicated = GaugeMetricFamily(
            "corolla_swarm_blocks_replicated", "Blocks with two or more online servers", labels=model
        )
        healthy = GaugeMetricFamily("corolla_swarm_healthy", "1 when every block has an online server", labels=model)
        servers = GaugeMetricFamily(
            "corolla_swarm_servers", "Servers by state (unreachable: missed the ping)", labels=[*model, "state"]
        )
        capacity = GaugeMetricFamily(
            "corolla_swarm_capacity_tokens_per_second", "Announced tokens/s of the weakest block", labels=model
        )
        served = GaugeMetricFamily(
            "corolla_swarm_tokens_per_second", "Decode tokens/s served since the previous refresh", labels=model
        )
        server = [*model, "peer_id"]
        up = GaugeMetricFamily(
            "corolla_swarm_server_up", "1 when the server answered the monitor's ping", labels=server
        )
        rtt = GaugeMetricFamily(
            "corolla_swarm_server_rtt_seconds", "Round trip of rpc_info from the monitor", labels=server
        )
        throughput = GaugeMetricFamily(
            "corolla_swarm_server_throughput_tokens_per_second", "Announced tokens/s per block", labels=server
        )
        cache_free = GaugeMetricFamily("corolla_swarm_server_cache_tokens_free", "Free KV-cache tokens", labels=server)
        cache_total = GaugeMetricFamily(
            "corolla_swarm_server_cache_tokens_total", "KV-cache budget in tokens", labels=server
        )
        sessions = GaugeMetricFamily(
            "corolla_swarm_server_sessions", "Inference sessions open on the server", labels=server
        )
        standbys = GaugeMetricFamily(
            "corolla_swarm_server_standby_sessions", "Of the sessions open on the server, standby replicas (as "
            "announced)", labels=server
        )
        steps = CounterMetricFamily(
            "corolla_swarm_server_decode_steps", "Session decode steps the server has served", labels=server
        )
        info = GaugeMetricFamily(
            "corolla_swarm_server_info",
            "Constant 1, with the server's blocks and build as labels",
            labels=[*server, "blocks", "state", "version", "dtype", "quant"],
        )
        for m in state.models:
            key = [m.dht_prefix]
            blocks.add_metric(key, m.num_blocks)
            covered.add_metric(key, sum(1 for c in m.coverage if c >= 1))
            replicated.add_metric(key, sum(1 for c in m.coverage if c >= 2))
            healthy.add_metric(key, 1.0 if m.healthy else 0.0)
            for name in _STATES:
                servers.add_metric([*key, name], sum(1 for s in m.servers if s.state == name))
            capacity.add_metric(key, m.capacity)
            if m.tokens_per_s is not None:
                served.add_metric(key, m.tokens_per_s)
            for s in m.servers:
                labels = [m.dht_prefix, s.peer_id]
                up.add_metric(labels, 1.0 if s.reachable else 0.0)
                if s.rtt_ms is not None:
                    rtt.add_metric(labels, s.rtt_ms / 1000)
                throughput.add_metric(labels, s.throughput)
                cache_free.add_metric(labels, s.cache_tokens_free)
                cache_total.add_metric(labels, s.cache_tokens_total)
                if s.active_sessions is not None:
                    sessions.add_metric(labels, s.active_sessions)
                standbys.add_metric(labels, s.standby_sessions)
                if s.decode_steps is not None:
                    steps.add_metric(labels, s.decode_steps)
                info.add_metric(
                    [*labels, f"{s.start_block}:{s.end_block}", s.state, s.version, s.torch_dtype, s.quant], 1.0
                )
        yield from (
            blocks,
            covered,
            replicated,
            healthy,
            servers,
            capacity,
            served,
            up,
            rtt,
            throughput,
            cache_free,
            cache_total,
            sessions,
            standbys,
            steps,
            info,
        )


def swarm_registry(monitor: SwarmMonitor) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding only the swarm collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(monitor))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)
