"""The swarm-at-scale harness on emulated hosts, at a small size: bench/bench_swarm_scale.py --hosts with 6 servers on
3 server hosts 30-80 ms apart, one of them behind a NAT (its servers relayed), 2 client sessions, and 60 s of churn
that also cuts hosts off the network. No session may fail, every output must equal the local HF model's, and every
process (in every namespace) must stop cleanly. The full size is the benchmark's (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from netswarm import needs_namespaces
from swarm_scale_checks import assert_nothing_lost, run_scale

pytestmark = [needs_namespaces, pytest.mark.net]


@pytest.mark.slow  # ~4 minutes of a dozen processes behind a user-space switch
def test_six_servers_on_emulated_hosts_under_churn_and_partitions_lose_no_session():
    result = run_scale(["--hosts", "3", "--private-hosts", "1", "--servers", "6", "--blocks", "8", "--span", "4",
                        "--clients", "2", "--client-procs", "2", "--dht-peers", "2", "--duration", "60",
                        "--warmup", "10", "--churn-period", "4", "--idle-window", "5", "--partition-s", "15",
                        "--seed", "1"])
    network = result["network"]
    assert network["network"] == "emulated hosts" and network["private_hosts"] == ["h2"], network
    assert 30 <= network["server_rtt_ms"]["min"] <= network["server_rtt_ms"]["max"] <= 80, network
    assert_nothing_lost(result, servers=6, clients=2, min_finished=4)
    churn = result["churn"]
    assert churn["partitioned"] >= 1 and churn["bootstrap_replaced"] == 1, churn
