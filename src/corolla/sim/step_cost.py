"""What a step costs a simulated server: the real engine's per-block step time against batch size, measured once.

How it was measured (2026-11-28, `python bench/bench_simulate.py --measure-step-cost`, median of 3 runs of 20-30
timed steps each): one Llama block (hidden 1,024, MLP 2,816, 16 attention heads, 4 key/value heads, float32) loaded
by `server.loading.blocks.load_stack` into a `server.compute.block_stack.BlockStack`, on 1 thread of an AMD EPYC
core (2-core machine, torch 2.13 CPU). A decode step of B sessions is `BlockStack.decode_batch` with B sessions each
holding 512 tokens (the path continuous batching takes; B = 1 is the plain cached step); a prefill is
`inference_step` of one prompt of T tokens.

    batch B               1     2     4     8     16    32    48    64
    ms per decode step    3.25  6.64  8.98  11.34 18.69 47.30 54.17 73.78
    tokens/s per block    308   301   445   705   856   677   886   867

    prompt tokens T       16     64     256    1024
    ms per prefill        9.99   22.29  76.64  328.80

A simulated server of speed `s` takes these times divided by `s` (its speed class says how much faster or slower
than this block on this core its hardware runs its blocks); between measured points times are interpolated
linearly, beyond them extrapolated from the last two. The shape is a CPU's: batching gains about 2.9x over a single
session (a GPU's decode step stays nearly flat up to far larger batches, which a scenario with another table would
show). Batch 32 measured slower per token than 16 or 48 in every run; it is kept as measured.
"""

from __future__ import annotations

import numpy as np

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64)
DECODE_SECONDS = (0.00325, 0.00664, 0.00898, 0.01134, 0.01869, 0.04730, 0.05417, 0.07378)
PREFILL_TOKENS = (16, 64, 256, 1024)
PREFILL_SECONDS = (0.00999, 0.02229, 0.07664, 0.32880)


def _extrapolated(x: float, xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
    if x <= xs[-1] or len(xs) < 2:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


def _check_table(name: str, xs: tuple[float, ...], ys: tuple[float, ...]) -> None:
    if not xs or len(xs) != len(ys):
        raise ValueError(f"{name}: needs as many seconds as sizes, at least one")
    if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] < 1 or any(y <= 0 for y in ys):
        raise ValueError(f"{name}: sizes must rise from >= 1 and every time be > 0 seconds")


class StepCost:
    """A per-block step-cost table (decode: seconds per step vs batch; prefill: seconds vs prompt tokens) at speed 1;
    a server of speed s takes the times divided by s. `MEASURED` is the table above."""

    def __init__(self, decode: tuple[tuple[float, float], ...], prefill: tuple[tuple[float, float], ...]):
        self.decode_batches = tuple(float(b) for b, _ in decode)
        self.decode_times = tuple(float(t) for _, t in decode)
        self.prefill_tokens = tuple(float(n) for n, _ in prefill)
        self.prefill_times = tuple(float(t) for _, t in prefill)
        _check_table("decode table", self.decode_batches, self.decode_times)
        _check_table("prefill table", self.prefill_tokens, self.prefill_times)

    def decode_seconds(self, batch: float, speed: float = 1.0) -> float:
        """Seconds one decode step of `batch` sessions takes through one block of a server of `speed`."""
        if batch <= 0 or speed <= 0:
            raise ValueError(f"batch and speed must be > 0, got {batch}, {speed}")
        return _extrapolated(max(batch, 1.0), self.decode_batches, self.decode_times) / speed

    def prefill_seconds(self, tokens: float, speed: float = 1.0) -> float:
        """Seconds one prompt of `tokens` tokens takes through one block of a server of `speed` (a prompt shorter
        than the first measured one costs as much as it: fixed costs dominate there)."""
        if tokens <= 0 or speed <= 0:
            raise ValueError(f"tokens and speed must be > 0, got {tokens}, {speed}")
        return _extrapolated(max(tokens, self.prefill_tokens[0]), self.prefill_tokens, self.prefill_times) / speed

    def best_rate(self, max_batch: int, speed: float = 1.0) -> float:
        """Tokens/s one block of a server of `speed` processes at its most efficient batch of at most `max_batch`."""
        return max(b / self.decode_seconds(b, speed) for b in range(1, max_batch + 1))


MEASURED = StepCost(tuple(zip(DECODE_BATCHES, DECODE_SECONDS)), tuple(zip(PREFILL_TOKENS, PREFILL_SECONDS)))


class BatchCurve:
    """The batch a server runs at to keep up with a given demand, vectorized for the fluid model (corolla.sim.fluid).

    rate(B) = B / decode_seconds(B) is not monotone (batch 32); a server whose demand needs rate r runs the smallest
    batch whose rate, or that of any smaller batch, reaches r: `batch_for(r)` inverts the running maximum of rate(B)
    over a grid of batches in steps of 1/8, up to `max_batch`.
    """

    def __init__(self, cost: StepCost, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        grid = np.arange(1.0, max_batch + 0.0625, 0.125)
        self.batches = grid
        self.seconds = np.array([cost.decode_seconds(b) for b in grid])
        envelope = np.maximum.accumulate(grid / self.seconds)
        keep = np.concatenate(([True], np.diff(envelope) > 0))  # strictly increasing, for np.interp
        self.rates, self.rate_batches = envelope[keep], grid[keep]
        self.peak = float(envelope[-1])  # tokens/s per block at the best batch, speed 1

    def batch_for(self, rate: np.ndarray) -> np.ndarray:
        """The batch (>= 1, <= max_batch) at which a speed-1 block keeps up with `rate` tokens/s."""
        return np.interp(rate, self.rates, self.rate_batches)

    def step_seconds(self, batch: np.ndarray) -> np.ndarray:
        """decode_seconds(batch) at speed 1, vectorized."""
        return np.interp(batch, self.batches, self.seconds)
