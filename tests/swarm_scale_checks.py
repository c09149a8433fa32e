"""The slow tests' runs of bench/bench_swarm_scale.py (on loopback, tests/swarm; on emulated hosts, tests/net): one
run, printed, and what every such run must show whatever its network: every server ready, every client loaded, no
session failed, enough finished, every output equal to the local HF model's, and a clean shutdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_swarm_scale import parser, run  # noqa: E402


def run_scale(argv: list[str]) -> dict:
    """The harness run with `argv` (its command line); its report, printed for the test's log."""
    result = run(parser().parse_args(argv))
    print(json.dumps(result, indent=2))
    return result


def assert_nothing_lost(result: dict, servers: int, clients: int, min_finished: int) -> None:
    sessions, shutdown = result["sessions"], result["shutdown"]
    assert result["startup"]["ready"] == servers, result["startup"]
    assert sessions["clients_loaded"] == clients, sessions
    assert sessions["failed"] == 0, sessions["errors"]
    assert sessions["finished"] >= min_finished, sessions
    assert sessions["hf_equal"] == sessions["finished"], sessions
    assert shutdown["clean"], shutdown
