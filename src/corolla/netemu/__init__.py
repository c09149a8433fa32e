"""Emulated hosts on one machine (network namespaces + a user-space switch adding latency and bandwidth caps),
for tests and benchmarks of a swarm across real-looking networks. Needs root; see `can_emulate()`."""

from corolla.netemu.hosts import EmulatedNetwork, can_emulate, sweep_stale
from corolla.netemu.links import Link, LinkModel, parse_ipv4
from corolla.netemu.process import HostProcess

__all__ = ["EmulatedNetwork", "HostProcess", "Link", "LinkModel", "can_emulate", "parse_ipv4", "sweep_stale"]
