"""What a simulation measured, and the JSON object `corolla simulate --json` prints.

Everything is counted after the warm-up (`Scenario.warmup`, while the servers join), over sessions that arrived
after it:

    served_tokens_per_s          tokens the sessions received per second (every generated token)
    capacity_bound_tokens_per_s  sum over present servers of (per-block token rate at their most efficient batch
                                 x blocks held) / model blocks, averaged over time: each server's rate when it
                                 serves all its blocks at once, so no placement or routing can serve more
    tpot_ms_p50 / p99            per finished session: (last token - first token) / (tokens - 1), stalls included
    ttft_s_p50 / p99             per finished session: first token - arrival
    admission_wait_s_p50 / p99   per session that got its cache everywhere: that moment - arrival
    failed_sessions              sessions that gave up (missing blocks, retries spent, stalled too long)
    uncovered_block_seconds      the integral of blocks that no ONLINE server serves
    burst_uncovered_blocks_max   most blocks uncovered after the burst; burst_recovery_s: how long until none
                                 was (0: none was; null: never within the run)
    moves_per_server_hour        moves started, over server-hours of servers present
    dht_bytes_per_server_per_min what servers store and read in the DHT (records x blocks on announce, every
                                 record of every block per read of the swarm), per server-minute
    dht_bytes_per_client_read    one client's read of every block's records
    leg_failures                 spans of sessions that failed and were re-routed
    wall_s                       seconds the simulation took on this machine
    cpu_s                        CPU seconds it took (wall_s less the time other processes had the cores)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from corolla.sim.sessions import SimSession


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Metrics:
    def __init__(self, warmup: float, burst_at: float | None):
        self.warmup = warmup
        self.burst_at = burst_at
        self.tokens = 0.0
        self.window = 0.0  # seconds measured
        self.bound_integral = 0.0
        self.server_seconds = 0.0
        self.uncovered_integral = 0.0
        self.tpot: list[float] = []
        self.ttft: list[float] = []
        self.admission: list[float] = []
        self.failures: dict[str, int] = {}
        self.finished_sessions = 0
        self.moves = 0
        self.leg_failures = 0
        self.batch_integral = 0.0
        self.burst_uncovered_max = 0
        self.burst_recovered_at: float | None = None
        self.dht_at_warmup: tuple[int, int] | None = None

    def _counted(self, s: SimSession) -> bool:
        return s.arrived >= self.warmup

    def admitted(self, s: SimSession, now: float) -> None:
        if self._counted(s):
            self.admission.append(now - s.arrived)

    def first_token(self, s: SimSession, now: float) -> None:
        if self._counted(s):
            self.ttft.append(now - s.arrived)

    def finished(self, s: SimSession, at: float) -> None:
        if self._counted(s):
            self.finished_sessions += 1
            assert s.first_token is not None
            self.tpot.append((at - s.first_token) / max(1, s.new_tokens - 1))

    def failed(self, s: SimSession, now: float, why: str) -> None:
        if self._counted(s):
            self.failures[why] = self.failures.get(why, 0) + 1

    def moved(self, now: float) -> None:
        if now >= self.warmup:
            self.moves += 1

    def leg_failure(self) -> None:
        self.leg_failures += 1

    def tick(self, now: float, dt: float, tokens: float, bound: float, servers: int, uncovered: int,
             mean_batch: float) -> None:
        """One tick ending at `now`: `tokens` decoded in it, the capacity `bound` and `servers` present, blocks
        `uncovered` now."""
        if now > self.warmup:
            self.tokens += tokens
            self.window += dt
            self.bound_integral += bound * dt
            self.server_seconds += servers * dt
            self.uncovered_integral += uncovered * dt
            self.batch_integral += mean_batch * dt
        if self.burst_at is not None and now >= self.burst_at:
            self.burst_uncovered_max = max(self.burst_uncovered_max, uncovered)
            if uncovered == 0 and self.burst_recovered_at is None and self.burst_uncovered_max > 0:
                self.burst_recovered_at = now

    def result(self, in_flight: int, dht: Any, wall: float, events: int, cpu: float = 0.0) -> dict[str, Any]:
        window = max(self.window, 1e-9)
        served, bound = self.tokens / window, self.bound_integral / window
        written, read = dht.bytes_written, dht.bytes_read_by_servers
        if self.dht_at_warmup is not None:
            written, read = written - self.dht_at_warmup[0], read - self.dht_at_warmup[1]
        ms = [t * 1e3 for t in self.tpot]
        burst: dict[str, Any] = {}
        if self.burst_at is not None:
            recovered = None if self.burst_recovered_at is None else self.burst_recovered_at - self.burst_at
            burst = {"burst_uncovered_blocks_max": self.burst_uncovered_max,
                     "burst_recovery_s": 0.0 if self.burst_uncovered_max == 0 else recovered}

        def rounded(value: float | None, digits: int) -> float | None:
            return None if value is None or math.isnan(value) else round(value, digits)

        return {
            "served_tokens_per_s": round(served, 1),
            "capacity_bound_tokens_per_s": round(bound, 1),
            "served_fraction_of_bound": round(served / bound, 3) if bound else None,
            "tpot_ms_p50": rounded(percentile(ms, 50), 1),
            "tpot_ms_p99": rounded(percentile(ms, 99), 1),
            "ttft_s_p50": rounded(percentile(self.ttft, 50), 3),
            "ttft_s_p99": rounded(percentile(self.ttft, 99), 3),
            "admission_wait_s_p50": rounded(percentile(self.admission, 50), 3),
            "admission_wait_s_p99": rounded(percentile(self.admission, 99), 3),
            "finished_sessions": self.finished_sessions,
            "failed_sessions": sum(self.failures.values()),
            "failed_by_reason": dict(sorted(self.failures.items())),
            "sessions_in_flight_at_end": in_flight,
            "uncovered_block_seconds": round(self.uncovered_integral, 1),
            **burst,
            "moves_per_server_hour": round(self.moves / max(self.server_seconds / 3600, 1e-9), 3),
            "moves": self.moves,
            "mean_decode_batch": round(self.batch_integral / window, 2),
            "leg_failures": self.leg_failures,
            "dht_bytes_per_server_per_min": round((written + read) / max(self.server_seconds / 60, 1e-9)),
            "dht_bytes_per_client_read": dht.client_read_bytes(),
            "events": events,
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),
        }
