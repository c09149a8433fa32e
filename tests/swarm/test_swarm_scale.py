"""A real swarm under churn at a small size: bench/bench_swarm_scale.py with 8 servers (some choosing their blocks,
some fixed), 4 client sessions generating greedily without a break, plain DHT peers, and 60 s of churn (SIGKILL,
SIGTERM, new servers, a burst of a quarter at once, a bootstrap peer killed and replaced). No session may fail, every
output must equal the local HF model's, and every process must stop cleanly (nothing left in any process group).
The full size (48 servers, 32 sessions) is the benchmark's; see docs/benchmarks.md, "A real swarm at scale"."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_swarm_scale import parser, run  # noqa: E402


@pytest.mark.slow  # ~4 minutes of a dozen processes
def test_eight_servers_under_churn_lose_no_session_and_stop_cleanly():
    args = parser().parse_args(["--servers", "8", "--blocks", "8", "--span", "4", "--clients", "4", "--client-procs",
                                "2", "--dht-peers", "4", "--duration", "60", "--warmup", "10", "--churn-period", "4",
                                "--idle-window", "5"])
    result = run(args)
    print(json.dumps(result, indent=2))
    sessions, shutdown = result["sessions"], result["shutdown"]
    assert result["startup"]["ready"] == 8, result["startup"]
    assert sessions["clients_loaded"] == 4, sessions
    assert sessions["failed"] == 0, sessions["errors"]
    assert sessions["finished"] >= 8, sessions
    assert sessions["hf_equal"] == sessions["finished"], sessions
    churn = result["churn"]
    assert churn["burst_killed"] >= 1 and churn["bootstrap_replaced"] == 1, churn
    assert churn["sigkill"] + churn["sigterm"] + churn["started"] >= 5, churn
    assert shutdown["clean"], shutdown
