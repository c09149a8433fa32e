"""A bounded, in-memory time series of the swarm: one sample per refresh, the oldest dropped first."""

from __future__ import annotations

from collections import deque

from corolla.monitor.schema import HistorySample, ModelSample, SwarmState


class History:
    """The last `length` samples (servers online, coverage, tokens/s, capacity per model). Lost on restart."""

    def __init__(self, length: int):
        if length < 1:
            raise ValueError("history length must be >= 1")
        self._samples: deque[HistorySample] = deque(maxlen=length)

    def add(self, state: SwarmState) -> HistorySample:
        """Append a sample of `state` (taken at state.updated_at) and return it."""
        sample = HistorySample(
            t=state.updated_at,
            models={
                m.dht_prefix: ModelSample(
                    servers_online=m.servers_online,
                    coverage=round(sum(1 for c in m.coverage if c > 0) / m.num_blocks, 4) if m.num_blocks else 0.0,
                    tokens_per_s=m.tokens_per_s,
                    capacity=m.capacity,
                )
                for m in state.models
            },
        )
        self._samples.append(sample)
        return sample

    def samples(self) -> list[HistorySample]:
        """Every sample kept, oldest first."""
        return list(self._samples)

    def __len__(self) -> int:
        return len(self._samples)
