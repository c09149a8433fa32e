"""`simulate(scenario)`: a whole swarm on one machine, no sockets, deterministic for a seed.

The `World` holds the clock (corolla.sim.events), the DHT (corolla.sim.dht), the servers (corolla.sim.servers),
the sessions (corolla.sim.sessions), the fluid decode model (corolla.sim.fluid) and the metrics; every decision is
the policy's (corolla.sim.policy: corolla's own code, or Petals' rules). One random generator, drawn from in event
order, makes a run a function of its scenario.

Clients: sessions arrive as a Poisson process asking, in all, `demand` x the capacity bound (tokens/s) at the
swarm's nominal size, each in a region drawn by the regions' client shares; or, with `clients`, that many clients
each run one session after another from half-way through the warm-up. A region's clients share one view of the swarm,
read every `update_period` (a real client reads its own; all of them are as stale).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from corolla.client.config import ClientConfig
from corolla.server.config import ServerConfig
from corolla.sim import servers as srv
from corolla.sim import sessions as ses
from corolla.sim.dht import SimDht
from corolla.sim.events import EventQueue
from corolla.sim.fluid import MIN_PREFILL_SHARE, Fluid
from corolla.sim.metrics import Metrics
from corolla.sim.policy import defaults, make_policy
from corolla.sim.scenario import Scenario, validated
from corolla.sim.step_cost import BatchCurve
from corolla.sim.wan import Wan

FORCED_REFRESH = 1.0  # seconds: a client re-reads the swarm at most this often while blocks are missing


def _exact_counts(shares: list[float], total: int) -> list[int]:
    """`total` split by `shares`, largest remainders first (sums to total)."""
    raw = [s * total for s in shares]
    counts = [math.floor(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass
class _Spans:
    key: Any
    dht: SimDht

    def spans(self) -> list[tuple[int, int, float]]:
        return [(r.start, r.end, r.share) for r in self.dht.records.values() if r.state.value != "offline"]


class World:
    def __init__(self, scenario: Scenario):
        self.scenario = s = validated(scenario)
        self.policy = make_policy(s.policy)
        self.rng = random.Random(s.seed)
        self.q = EventQueue()
        self.wan = Wan(s.rtt_ms, s.access_ms)
        self.dht = SimDht(s.blocks)
        self.cost = s.step_cost()
        server_defaults, client_defaults = defaults(ServerConfig), defaults(ClientConfig)
        self.curve = BatchCurve(self.cost, server_defaults["max_batch_size"])
        self.fluid = Fluid(self.curve, s.hop_overhead)
        self.metrics = Metrics(s.warmup, s.burst_at if s.burst_fraction > 0 else None)
        self.policy_peer_share = server_defaults["max_peer_cache_share"]
        self.merge_max_tokens = server_defaults["merge_max_tokens"]
        self.cache_patience = server_defaults["cache_queue_patience"]
        self.alloc_timeout = min(client_defaults["alloc_timeout"], server_defaults["max_alloc_timeout"])
        self.missing_wait = client_defaults["missing_blocks_wait"]
        self.max_retries = client_defaults["max_retries"]
        self.servers: list[srv.SimServer] = []
        self.peer_ids: dict[str, int] = {}
        self.sessions: dict[int, ses.SimSession] = {}
        self.slot_sessions: dict[int, ses.SimSession] = {}
        self.online = np.zeros(s.blocks, dtype=np.int64)  # per block: ONLINE servers serving it
        self._views: dict[int, tuple[float, Any]] = {}
        self._snapshot: tuple[float, Any] | None = None
        self._next_session = 0
        self._client_bans: dict[int, dict] = {}
        self._prefill_seconds: dict[int, float] = {}  # prompt tokens -> prefill seconds per block at speed 1
        self.regions_servers = [r.servers for r in s.regions]
        self.regions_clients = [r.clients for r in s.regions]

    # ------------------------------------------------------------------ servers
    def add_server(self, kind_index: int, region: int, at: float, fixed: tuple[int, int] | None = None) -> None:
        s = self.scenario
        kind = s.classes[kind_index]
        index = len(self.servers)
        server = srv.SimServer(
            id=index, peer=f"sim{index:06d}", region=region, access=self.wan.draw_access(self.rng), kind=kind,
            throughput=self.policy.announced_throughput(self.cost, kind.speed, kind.blocks),
            inference_rate=1.0 / self.cost.decode_seconds(1, kind.speed), fixed=fixed)
        self.servers.append(server)
        self.peer_ids[server.peer] = index
        self.fluid.set_server(index, kind.speed, kind.blocks)
        self.q.at(at, srv.appear, self, server)
        if s.churn > 0:
            lifetime = self.rng.lognormvariate(math.log(s.churn), s.churn_sigma)
            self.q.at(at + lifetime, self._churn, server, kind_index, region)

    def _churn(self, server: srv.SimServer, kind_index: int, region: int) -> None:
        if not server.alive:
            return
        srv.leave(self, server, crash=self.rng.random() < self.scenario.crash_fraction)
        self.add_server(kind_index, region, self.q.now + self.scenario.rejoin_delay)

    def _burst(self) -> None:
        s = self.scenario
        regions = {r.name: i for i, r in enumerate(s.regions)}
        present = [x for x in self.servers if x.alive and x.state != "starting"
                   and (s.burst_region is None or x.region == regions[s.burst_region])]
        count = round(s.burst_fraction * len([x for x in self.servers if x.alive and x.state != "starting"]))
        for server in self.rng.sample(present, min(count, len(present))):
            srv.leave(self, server, crash=True)
            if s.burst_return > 0:
                kind = s.classes.index(server.kind)
                self.add_server(kind, server.region, self.q.now + s.burst_return)

    def coverage_changed(self, server: srv.SimServer, sign: int) -> None:
        self.online[server.start : server.end] += sign

    def swarm_spans(self) -> _Spans:
        return _Spans((self.dht.placement_version, math.floor(self.q.now / 30.0)), self.dht)

    # ------------------------------------------------------------------ clients
    def index_for(self, region: int, force: bool = False) -> Any:
        """The route index of `region`'s clients: their view of the swarm, re-read every update_period (and at
        most every FORCED_REFRESH seconds while a client waits for missing blocks)."""
        now = self.q.now
        built = self._views.get(region)
        age = now - built[0] if built else float("inf")
        if age < self.policy.update_period and not (force and age >= FORCED_REFRESH):
            return built[1]
        if self._snapshot is None or self._snapshot[0] != now:
            self._snapshot = (now, self.policy.snapshot(self.dht))
        self.dht.read_all(by_server=False)
        s = self.scenario
        access = s.access_ms / 1e3  # a typical client of the region
        rtts = {x.peer: self.wan.rtt(region, access, x.region, x.access) for x in self.servers
                if x.id in self.dht.records}
        index = self.policy.index(self._snapshot[1], s.prompt_max + s.new_tokens_max, rtts, s.blocks)
        self._views[region] = (now, index)
        return index

    def rtt(self, session: ses.SimSession, server: srv.SimServer) -> float:
        return self.wan.rtt(session.region, session.access, server.region, server.access)

    def legs_seconds(self, s: ses.SimSession) -> float:
        """Network seconds per token of `s`'s route: relayed, a round trip per span; pushed, one-way legs from
        the client through every server and back."""
        hosts = [self.servers[leg.server] for leg in s.legs]
        if self.policy.relays:
            return sum(self.rtt(s, h) for h in hosts)
        seconds = (self.rtt(s, hosts[0]) + self.rtt(s, hosts[-1])) / 2
        for a, b in zip(hosts, hosts[1:]):
            seconds += self.wan.rtt(a.region, a.access, b.region, b.access) / 2
        return seconds

    def prefill_visit(self, server_id: int, blocks: int, tokens: int, chunked: bool = False) -> float:
        """Seconds a prefill of `tokens` tokens spends at a server over `blocks` blocks; its compute joins the
        server's prefill backlog (the fluid model's prefill share). `chunked`: the client sends it in chunks each
        short enough to be merged (a failover's replay, client.chain.route_opening.replay), all at decode priority."""
        server, f = self.servers[server_id], self.fluid
        seconds = self._prefill_seconds.get(tokens)
        if seconds is None:  # at speed 1, once per length (numpy's interpolation of one number is slow)
            seconds = self._prefill_seconds[tokens] = self.cost.prefill_seconds(tokens)
        work = blocks * (seconds / server.kind.speed)
        if tokens <= self.merge_max_tokens or chunked:  # merged tasks at decode priority (server.compute.planner)
            f.prefill_now[server_id] += work
            return work / max(float(f.avail[server_id]), MIN_PREFILL_SHARE) + f.wait[server_id] + \
                self.scenario.hop_overhead
        f.prefill_work[server_id] += work
        # the server works through its prefills in order, at the share of its time it gives them
        share = min(max(1.0 - float(f.busy[server_id]), MIN_PREFILL_SHARE), 1.0 - MIN_PREFILL_SHARE)
        return f.prefill_work[server_id] / share + f.wait[server_id] + self.scenario.hop_overhead

    def _arrive(self) -> None:
        self._new_session(None)
        self.q.after(self.rng.expovariate(self._arrival_rate), self._arrive)

    def _new_session(self, client: int | None) -> None:
        s = self.scenario
        region = self.rng.choices(range(len(s.regions)), weights=self.regions_clients)[0]
        session = ses.SimSession(
            id=self._next_session, region=region, access=self.wan.draw_access(self.rng),
            prompt=self.rng.randint(s.prompt_min, s.prompt_max),
            new_tokens=self.rng.randint(s.new_tokens_min, s.new_tokens_max), arrived=self.q.now, client=client)
        self._next_session += 1
        if client is not None:  # a client keeps its bans from one session to the next (its SequenceManager's)
            session.bans = self._client_bans.setdefault(client, {})
        self.sessions[session.id] = session
        ses.start(self, session)

    def session_over(self, s: ses.SimSession, at: float) -> None:
        self.sessions.pop(s.id, None)
        if s.client is not None:
            self.q.at(at, self._new_session, s.client)

    def leg_failed(self, session_id: int, leg: int, kind: str) -> None:
        s = self.sessions.get(session_id)
        if s is not None:
            ses.leg_failed(self, s, leg, kind)

    def leg_granted(self, session_id: int, leg: int) -> None:
        s = self.sessions.get(session_id)
        if s is not None:
            ses.leg_granted(self, s, leg)

    def server_failed(self, session_id: int, server_id: int, kind: str) -> None:
        """A server holding part of a session failed: a crash is noticed at the session's next step."""
        s = self.sessions.get(session_id)
        if s is None:
            return
        delay = 0.0
        if kind == "crash" and s.slot is not None:
            delay = min(1.0 / max(float(self.fluid.rate[s.slot]), 1e-3), 2.0)
        self.q.after(delay, ses.server_failed, self, s, server_id, kind)

    # ------------------------------------------------------------------ the run
    def nominal_bound(self) -> float:
        s = self.scenario
        peak = self.curve.peak
        return sum(c.share * s.servers * c.speed * peak for c in s.classes) / s.blocks

    def _tick(self) -> None:
        dt, now = self.scenario.tick, self.q.now
        tokens, finished, at = self.fluid.advance(now, dt)
        for slot, when in zip(finished.tolist(), at.tolist()):
            session = self.slot_sessions.get(slot)
            if session is not None:
                ses.finish(self, session, when)
        self.fluid.solve(dt)
        if self.policy.admits_by_compute:  # a server back under its peak lets the sessions waiting for it in
            # (nothing while it is still saturated: those are skipped, as grant() would; a grant changes no overload)
            for index in srv.under_peak(self):
                server = self.servers[index]
                if server.queue and server.alive:
                    srv.grant(self, server)
        present = [x for x in self.servers if x.alive and x.state not in ("starting",)]
        bound = sum(x.kind.speed for x in present) * self.curve.peak / self.scenario.blocks
        busy = self.fluid.demand[: len(self.servers)] > 0
        batch = float(self.fluid.batch[: len(self.servers)][busy].mean()) if busy.any() else 0.0
        self.metrics.tick(now, dt, tokens, bound, len(present), int((self.online == 0).sum()), batch)
        if self.metrics.dht_at_warmup is None and now >= self.scenario.warmup:
            self.metrics.dht_at_warmup = (self.dht.bytes_written, self.dht.bytes_read_by_servers)
        if now + dt <= self.scenario.duration + 1e-9:
            self.q.at(now + dt, self._tick)

    def start(self) -> None:
        """Schedule the servers' arrivals, the burst, the clients and the ticks (run_until then plays them)."""
        s = self.scenario
        kinds = [i for i, count in enumerate(_exact_counts([c.share for c in s.classes], s.servers))
                 for _ in range(count)]
        regions = [i for i, count in enumerate(_exact_counts(self.regions_servers, s.servers)) for _ in range(count)]
        self.rng.shuffle(kinds)
        self.rng.shuffle(regions)
        for i, (kind, region) in enumerate(zip(kinds, regions)):
            fixed = s.placements[i] if i < len(s.placements) else None  # its blocks; its class: speed and cache
            self.add_server(kind, region, self.rng.uniform(0.0, s.join_period), fixed)
        if s.burst_fraction > 0 and s.burst_at < s.duration:
            self.q.at(s.burst_at, self._burst)
        if s.clients > 0:
            for client in range(s.clients):  # from half-way through the warm-up: the servers have joined
                self.q.at(s.warmup / 2, self._new_session, client)
        else:
            self._arrival_rate = s.demand * self.nominal_bound() / ((s.new_tokens_min + s.new_tokens_max) / 2)
            self.q.at(self.rng.expovariate(self._arrival_rate), self._arrive)
        self.q.at(s.tick, self._tick)

    def run(self) -> dict[str, Any]:
        begin, cpu = time.perf_counter(), time.process_time()
        self.start()
        self.q.run_until(self.scenario.duration)
        s = self.scenario
        result = self.metrics.result(len(self.sessions), self.dht, time.perf_counter() - begin, self.q.events,
                                     time.process_time() - cpu)
        return {"policy": s.policy, "seed": s.seed, **result}


def simulate(scenario: Scenario) -> dict[str, Any]:
    """Run `scenario`; the JSON object of corolla.sim.metrics (plus policy and seed)."""
    return World(scenario).run()
