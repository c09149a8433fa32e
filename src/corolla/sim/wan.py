"""Where simulated hosts are and how far apart: regions with round trips between them, plus each host's access.

A host (server or client) lives in a region and adds its own access latency, drawn once per host uniformly from
0 to 2 x `access_ms` (the last mile: home links, a cloud zone). The round trip between two hosts is the round trip
between their regions plus both hosts' access latencies; a one-way trip is half of it. Round trips are fixed per
pair: step-to-step jitter averages out over the hundreds of tokens a session runs, which is what the fluid model
(corolla.sim.fluid) keeps.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np


class Wan:
    def __init__(self, rtt_ms: Sequence[Sequence[float]], access_ms: float):
        self.region_rtt = np.asarray(rtt_ms, dtype=float) / 1e3  # seconds, region x region
        self.access = access_ms / 1e3

    def draw_access(self, rng: random.Random) -> float:
        """A new host's access latency, seconds."""
        return rng.uniform(0.0, 2.0 * self.access)

    def rtt(self, region_a: int, access_a: float, region_b: int, access_b: float) -> float:
        """Round trip between two hosts, seconds."""
        return float(self.region_rtt[region_a, region_b]) + access_a + access_b

    def rtts_to(self, region: int, access: float, regions: np.ndarray, accesses: np.ndarray) -> np.ndarray:
        """Round trips from one host to many (their regions and access latencies as arrays), seconds."""
        return self.region_rtt[region, regions] + access + accesses
