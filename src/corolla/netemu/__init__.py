"""Emulated hosts on one machine (network namespaces + a user-space switch adding latency and bandwidth caps),
for tests and benchmarks of a swarm across real-looking networks. Needs root; see `can_emulate()`."""

from corolla.netemu.hosts import EmulatedNetwork, can_emulate, sweep_stale
from corolla.netemu.links import Link, LinkModel, parse_ipv4
from corolla.netemu.process import HostProcess
from corolla.netemu.swarm import Agent, start_dht, start_server, wait_serving

__all__ = ["Agent", "EmulatedNetwork", "HostProcess", "Link", "LinkModel", "can_emulate", "parse_ipv4",
           "start_dht", "start_server", "sweep_stale", "wait_serving"]
