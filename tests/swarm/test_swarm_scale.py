"""A real swarm under churn at a small size: bench/bench_swarm_scale.py with 8 servers (some choosing their blocks,
some fixed), 4 client sessions generating greedily without a break, plain DHT peers, and 60 s of churn (SIGKILL,
SIGTERM, new servers, a burst of a quarter at once, a bootstrap peer killed and replaced). No session may fail, every
output must equal the local HF model's, and every process must stop cleanly (nothing left in any process group).
The full size (48 servers, 32 sessions) is the benchmark's; see docs/benchmarks.md, "A real swarm at scale"."""

from __future__ import annotations

import pytest

from swarm_scale_checks import assert_nothing_lost, run_scale


@pytest.mark.slow  # ~4 minutes of a dozen processes
def test_eight_servers_under_churn_lose_no_session_and_stop_cleanly():
    result = run_scale(["--servers", "8", "--blocks", "8", "--span", "4", "--clients", "4", "--client-procs", "2",
                        "--dht-peers", "4", "--duration", "60", "--warmup", "10", "--churn-period", "4",
                        "--idle-window", "5"])
    assert_nothing_lost(result, servers=8, clients=4, min_finished=8)
    churn = result["churn"]
    assert churn["burst_killed"] >= 1 and churn["bootstrap_replaced"] == 1, churn
    assert churn["sigkill"] + churn["sigterm"] + churn["started"] >= 5, churn
