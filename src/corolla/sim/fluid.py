"""Decoding as a fluid: every decoding session advances at a rate (tokens/s) set by the servers on its route.

One event per token and hop would be ~10^9 events for an hour of a thousand servers; instead each `tick` the rates
are solved for and the sessions' tokens advance by rate x tick. Per server s (speed v, k blocks):

    demand    D_s = sum over its sessions of rate x blocks they use on it          (block-tokens/s)
    batch     B_s = the batch at which v x (B / step(B)) keeps up with D_s (step_cost.BatchCurve), at most
              max_batch (its most efficient batch while it has a queue, o_s > 1). Prefills as the real worker
              runs them: a short one (at most ServerConfig.merge_max_tokens) at decode priority, taking its
              time from decoding; long ones (replays after a failover) from a backlog carried from tick to tick,
              in the time decoding leaves, at least MIN_PREFILL_SHARE
    step      c_s = step(B_s) / v / (1 - prefill share)              (seconds per block per decode step)
    overload  o_s: a queue in front of a saturated server, multiplied each tick by sqrt(D_s / peak rate) and
              never below 1: it grows while the server is asked more than its peak, shrinks back after
    busy      rho_s = min(1, D_s x c_s / B_s)
    a visit of m blocks costs  m x c_s x o_s  +  rho_s x k x c_s / 2  +  hop overhead
              (its own step, plus half of the step already running when it arrives)

and a session's time per token is the sum of its visits plus its network legs and the client's own time; its rate
is 1 / that. Rates and demands depend on each other, so each tick iterates twice from the last tick's rates,
damped by half (rates that overshoot a saturated server come back within a few ticks, as queues would). This is
the real scheduler's rule (server.compute.worker: steps that queue while a batch runs go together in the next, up
to max_batch), averaged over a tick; what it leaves out: steps of one server over different spans batch apart in
the real server (here they batch together), and step-to-step jitter.

Layout: a saturated swarm of a thousand servers has ~50,000 sessions decoding over ~10 hops each, so a tick is a
few sparse matrix-vector products, not a loop over sessions. Each decoding session is a row of a CSR matrix
(sessions x servers) whose entries are the blocks it uses on each server: the servers' demands are its transpose
times the rates, the sessions' compute times it times the seconds per block, and the same pattern with ones times
the servers' waits. Rows are appended as sessions start; a session that stops leaves a row of zeros behind, and the
rows are compacted when more than half are such. A session keeps its slot (the index of its rate, tokens, ...)
from start to stop; `row_of` maps it to its current row.
scipy.sparse does the products (scipy comes with hivemind, a dependency); on 50,000 sessions of 5-14 hops a solve
took a third of the time of the padded sessions x hops arrays it replaced, with the same rates to 1e-13.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix

from corolla.sim.step_cost import BatchCurve

MIN_PREFILL_SHARE = 0.1  # the share of a saturated server's time prefills still get (between decode batches)


class Fluid:
    def __init__(self, curve: BatchCurve, hop_overhead: float):
        self.curve = curve
        self.hop_overhead = hop_overhead
        self.slots = 0  # allocated session slots
        # per session slot
        self.net = np.zeros(0)  # seconds per token outside servers' steps
        self.rate = np.zeros(0)  # tokens/s
        self.tokens = np.zeros(0)  # decoded so far
        self.target = np.zeros(0)  # tokens to decode
        self.since = np.zeros(0)  # when it (re)started decoding, simulated seconds
        self.hops = np.zeros(0)  # servers it visits per token
        self.row_of = np.zeros(0, dtype=np.int64)  # its row in the matrix (module docstring)
        self.active = np.zeros(0, dtype=bool)
        self.free: list[int] = []
        # the matrix: rows[0:rows], hops[0:indptr[rows]] (int32 indices: scipy takes them as they are, no copy)
        self.rows = 0
        self.indptr = np.zeros(1, dtype=np.int32)
        self.row_slot = np.zeros(0, dtype=np.int64)
        self.row_live = np.zeros(0, dtype=bool)
        self.hop_server = np.zeros(0, dtype=np.int32)
        self.hop_blocks = np.zeros(0)
        self.hop_one = np.zeros(0)  # 1 for a hop of a live row, else 0
        self.live_rows = 0
        # per server, updated by `solve`
        self.speed = np.ones(1)
        self.span = np.ones(1)
        self.prefill_work = np.zeros(1)  # seconds of long prefills each server still has to do (a backlog)
        self.prefill_now = np.zeros(1)  # seconds of short prefills asked since the last solve (run at once)
        self.avail = np.ones(1)  # share of time left for decoding
        self.per_block = np.zeros(1)  # seconds per block per token, queueing included
        self.wait = np.zeros(1)  # seconds a visit waits for the step already running
        self.batch = np.ones(1)
        self.demand = np.zeros(1)
        self.overload = np.ones(1)  # per server: how much longer steps take for the queue in front of them
        self.busy = np.zeros(1)  # per server: the share of its time decoding took at the last solve

    # ------------------------------------------------------------------ servers
    def ensure_servers(self, count: int) -> None:
        """Room for server indices < count."""
        if count <= len(self.speed):
            return
        size = max(count, 2 * len(self.speed))
        for name, fill in (("speed", 1.0), ("span", 1.0), ("prefill_work", 0.0), ("prefill_now", 0.0), ("avail", 1.0),
                           ("per_block", 0.0), ("wait", 0.0), ("batch", 1.0), ("demand", 0.0),
                           ("overload", 1.0), ("busy", 0.0)):
            old = getattr(self, name)
            new = np.full(size, fill)
            new[: len(old)] = old
            setattr(self, name, new)

    def set_server(self, index: int, speed: float, span: int) -> None:
        self.ensure_servers(index + 1)
        self.speed[index], self.span[index] = speed, max(1, span)

    # ------------------------------------------------------------------ sessions
    def add(self, hops: list[tuple[int, int]], net: float, tokens: float, target: float, now: float) -> int:
        """A session decoding from `now` over `hops` [(server, blocks used)]: its slot."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self._append_row(slot, hops)
        self.net[slot], self.tokens[slot], self.target[slot], self.since[slot] = net, tokens, target, now
        self.hops[slot] = len(hops)
        self.rate[slot] = 1.0 / self.token_seconds(hops, net)
        self.active[slot] = True
        return slot

    def remove(self, slot: int) -> float:
        """Stop the session in `slot`; returns the tokens it decoded."""
        self.active[slot] = False
        self.rate[slot] = 0.0
        row = int(self.row_of[slot])
        begin, end = self.indptr[row], self.indptr[row + 1]
        self.hop_blocks[begin:end] = 0.0
        self.hop_one[begin:end] = 0.0
        self.row_live[row] = False
        self.live_rows -= 1
        self.hops[slot] = 0.0
        self.free.append(slot)
        return float(self.tokens[slot])

    def token_seconds(self, hops: list[tuple[int, int]], net: float) -> float:
        """Seconds per token over `hops` at the servers' current state."""
        return net + sum(blocks * self.per_block[s] + self.wait[s] + self.hop_overhead for s, blocks in hops)

    def _grow(self) -> None:
        extra = max(1024, self.slots)
        for name in ("net", "rate", "tokens", "target", "since", "hops"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra)]))
        self.row_of = np.concatenate([self.row_of, np.zeros(extra, dtype=np.int64)])
        self.active = np.concatenate([self.active, np.zeros(extra, dtype=bool)])
        self.free.extend(range(self.slots + extra - 1, self.slots - 1, -1))
        self.slots += extra

    def _append_row(self, slot: int, hops: list[tuple[int, int]]) -> None:
        if self.rows >= len(self.row_slot) or self.indptr[self.rows] + len(hops) > len(self.hop_server):
            if self.rows > 2 * self.live_rows + 1024:
                self._compact()
            else:
                self._grow_rows(len(hops))
        row, begin = self.rows, int(self.indptr[self.rows])
        end = begin + len(hops)
        for position, (server, blocks) in enumerate(hops, begin):
            self.hop_server[position] = server
            self.hop_blocks[position] = blocks
        self.hop_one[begin:end] = 1.0
        self.indptr[row + 1] = end
        self.row_slot[row], self.row_live[row], self.row_of[slot] = slot, True, row
        self.rows += 1
        self.live_rows += 1

    def _grow_rows(self, needed: int) -> None:
        rows = max(1024, 2 * len(self.row_slot))
        hops = max(8192, 2 * len(self.hop_server), int(self.indptr[self.rows]) + needed)
        self.indptr = np.concatenate([self.indptr, np.zeros(rows + 1 - len(self.indptr), dtype=np.int32)])
        self.row_slot = np.concatenate([self.row_slot, np.zeros(rows - len(self.row_slot), dtype=np.int64)])
        self.row_live = np.concatenate([self.row_live, np.zeros(rows - len(self.row_live), dtype=bool)])
        more = hops - len(self.hop_server)
        self.hop_server = np.concatenate([self.hop_server, np.zeros(more, dtype=np.int32)])
        self.hop_blocks = np.concatenate([self.hop_blocks, np.zeros(more)])
        self.hop_one = np.concatenate([self.hop_one, np.zeros(more)])

    def _compact(self) -> None:
        """Drop the rows of sessions that stopped (keeping the others in order)."""
        rows, used = self.rows, int(self.indptr[self.rows])
        live = np.flatnonzero(self.row_live[:rows])
        lengths = np.diff(self.indptr[: rows + 1])
        keep = np.repeat(self.row_live[:rows], lengths)
        count = int(keep.sum())
        for name in ("hop_server", "hop_blocks", "hop_one"):
            array = getattr(self, name)
            array[:count] = array[:used][keep]
            array[count:used] = 0
        self.indptr[1 : len(live) + 1] = np.cumsum(lengths[live])
        self.indptr[len(live) + 1 :] = 0
        self.row_slot[: len(live)] = self.row_slot[live]
        self.row_live[: len(live)] = True
        self.row_live[len(live) :] = False
        self.rows = len(live)
        self.row_of[self.row_slot[: self.rows]] = np.arange(self.rows)
        if self.rows >= len(self.row_slot) or count + 64 > len(self.hop_server):
            self._grow_rows(64)

    # ------------------------------------------------------------------ a tick
    def solve(self, dt: float, iterations: int = 2) -> None:
        """New rates for every active session, and each server's state (see the module docstring)."""
        merged = np.minimum(self.prefill_now / dt, 1.0 - MIN_PREFILL_SHARE)  # short prompts, at decode priority
        self.prefill_now[:] = 0.0
        share = np.minimum(self.prefill_work / dt, self.prefill_share())
        self.prefill_work -= share * dt
        # decode steps go first: long prefills slow decoding only by what they take beyond the time left idle
        self.avail = np.maximum(MIN_PREFILL_SHARE, 1.0 - merged - np.maximum(0.0, share + self.busy - 1.0))
        rows, size = self.rows, len(self.speed)
        used = int(self.indptr[rows])
        pattern = (self.hop_server[:used], self.indptr[: rows + 1])
        blocks = csr_matrix((self.hop_blocks[:used], *pattern), shape=(rows, size), copy=False)  # sessions x servers
        ones = csr_matrix((self.hop_one[:used], *pattern), shape=(rows, size), copy=False)
        live = np.flatnonzero(self.row_live[:rows])
        slots = self.row_slot[live]
        outside = self.net[slots] + self.hops[slots] * self.hop_overhead  # the network, and every hop's overhead
        row_rate = np.zeros(rows)
        rate = self.rate[slots]
        row_rate[live] = rate
        capacity = self.speed * self.avail  # speed-1 block equivalents
        for _ in range(iterations):
            demand = blocks.T @ row_rate
            normalized = demand / capacity
            # a server with a queue runs full batches; else the batch that keeps up with its demand
            batch = np.where(self.overload > 1.0, self.curve.rate_batches[-1], self.curve.batch_for(normalized))
            step = self.curve.step_seconds(batch) / capacity
            busy = np.minimum(1.0, demand * step / batch)
            per_block = step * self.overload
            wait = 0.5 * busy * self.span * step
            visits = (blocks @ per_block + ones @ wait)[live]
            rate = 0.5 * (rate + 1.0 / (outside + visits))
            row_rate[live] = rate
        self.rate[slots] = rate
        # a queue in front of a saturated server: grows while the demand the new rates make passes its peak,
        # shrinks back to none once it is below
        demand = blocks.T @ row_rate
        self.overload = np.maximum(1.0, self.overload * np.sqrt(demand / capacity / self.curve.peak))
        self.demand, self.batch, self.per_block, self.wait = demand, batch, per_block, wait
        # the share of its full time decoding takes (what the next tick's prefills may not use)
        self.busy = np.minimum(1.0, demand * self.curve.step_seconds(batch) / self.speed / batch)

    def advance(self, now: float, dt: float) -> tuple[float, np.ndarray, np.ndarray]:
        """Decode the `dt` seconds up to `now` (a session that started decoding since, from then on): returns
        (tokens decoded in all, slots that finished, the time each finished). Tokens stop at the target."""
        active = np.flatnonzero(self.active)
        before, rate, target = self.tokens[active], self.rate[active], self.target[active]
        begin = np.maximum(self.since[active], now - dt)
        after = np.minimum(before + rate * (now - begin), target)
        self.tokens[active] = after
        done = after >= target
        at = begin[done] + (target[done] - before[done]) / np.maximum(rate[done], 1e-12)
        return float((after - before).sum()), active[done], np.minimum(at, now)

    def prefill_share(self) -> np.ndarray:
        """Per server, the share of its time long prefills get: what decoding left at the last solve, at least
        MIN_PREFILL_SHARE, and at most all but that (decode steps that arrive go first)."""
        return np.clip(1.0 - self.busy, MIN_PREFILL_SHARE, 1.0 - MIN_PREFILL_SHARE)

    def announced_step_seconds(self, server: int) -> float:
        """What the server would announce as its step_seconds: per block, its step plus its share of the wait."""
        return float(self.per_block[server] + self.wait[server] / self.span[server])
