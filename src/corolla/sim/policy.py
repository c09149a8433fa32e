"""The rules simulated servers and clients follow: `CorollaPolicy` calls corolla's own code, with its own defaults
(ServerConfig, ClientConfig); `corolla.sim.petals.PetalsPolicy` follows Petals 2.2's rules. The simulator asks a
policy every decision a real server or client makes, and nothing else:

    server   announced throughput and placement share, join delay, block choice, settling before loading, the
             coverage watch, balance checks, the move decision, stagger and drain, announce period and expiry
    client   route (through the route index of its view), ban, retry delay, retry limit, view refresh period,
             whether it relays every hop (Petals) or pushes (corolla)
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from corolla.client.config import ClientConfig
from corolla.client.swarm.bans import Ban, next_ban, retry_delay
from corolla.client.swarm.route_index import RouteIndex, route_index
from corolla.client.swarm.routing import Span, find_route_in
from corolla.protocol.messages import ServerInfo
from corolla.server.config import ServerConfig
from corolla.server.presence import rebalancing
from corolla.server.presence.block_selection import choose_joining_blocks
from corolla.server.presence.rebalancing import Move
from corolla.sim.dht import SimDht
from corolla.sim.step_cost import StepCost


class SwarmSpans(Protocol):
    """Every JOINING or ONLINE server's (start, end, placement share), read lazily (only Petals' move rule needs
    them all), and a key that changes whenever they may have (for caching what is computed from them)."""

    key: Any

    def spans(self) -> list[tuple[int, int, float]]: ...


def defaults(cls: type) -> dict[str, Any]:
    """Every field default of a config dataclass (the product's own, never re-declared here)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


class Policy(Protocol):
    name: str
    relays: bool  # the client relays every hop (a round trip per span) instead of pushing
    # the client opens a route's spans at once and, if one fails, closes them all and routes their blocks again
    # (corolla's open_route); else each failed span is routed again alone, the others kept open
    opens_at_once: bool
    load_aware: bool  # servers announce their load and clients price it
    # a server past its compute's peak grants no cache (server.compute.saturation): new sessions wait in its queue
    admits_by_compute: bool
    # a failover's replay goes in chunks short enough for servers to run at decode priority (corolla's replay);
    # else whole, a long prefill at the priority servers give long prefills
    replays_in_short_chunks: bool
    announce_period: float
    expiration: float
    update_period: float
    max_stall: float  # seconds a session retries before its user gives up

    def announced_throughput(self, cost: StepCost, speed: float, blocks: int) -> float: ...
    def placement_share(self, throughput: float, start: int, end: int) -> float: ...
    def join_delay(self, rng: random.Random) -> float: ...
    def choose(self, capacity: Sequence[float], blocks: int, rng: random.Random) -> tuple[int, int]: ...
    def settle_delay(self, rng: random.Random) -> float | None: ...
    def settle(self, me: str, current: tuple[int, int], share: float, capacity: Sequence[float],
               joining_here: Mapping[str, tuple[int, int, float]]) -> tuple[int, int] | None: ...
    def watch_period(self, holders: Sequence[int]) -> float | None: ...
    def check_delay(self, rng: random.Random) -> float: ...
    def plan(self, current: tuple[int, int], share: float, capacity: Sequence[float], since_last_move: float,
             rng: random.Random, swarm: SwarmSpans) -> Move | None: ...
    def stagger(self, rng: random.Random, move: Move) -> float: ...
    def drain(self, move: Move) -> float: ...
    def snapshot(self, dht: SimDht) -> Any: ...
    def index(self, snapshot: Any, need: int, rtts: Mapping[str, float], blocks: int) -> Any: ...
    def route(self, index: Any, start: int, end: int, rng: random.Random,
              banned: Collection[str]) -> list[Span] | None: ...
    def ban(self, previous: Ban | None, now: float, unreachable: bool) -> Ban: ...
    def retry_delay(self, failures: int) -> float: ...
    def gives_up(self, failures: int) -> bool: ...


class CorollaPolicy:
    """corolla's rules: server.presence.block_selection and .rebalancing, client.swarm.routing and .bans, with
    ServerConfig's and ClientConfig's defaults."""

    name = "corolla"
    relays = False
    opens_at_once = True  # client.chain.route_opening.open_route
    admits_by_compute = True  # server.cache.queue.grants(saturated=...), server.compute.saturation
    load_aware = True
    replays_in_short_chunks = True  # client.chain.route_opening.replay: chunks servers run at decode priority

    def __init__(self) -> None:
        self.server = defaults(ServerConfig)
        self.client = defaults(ClientConfig)
        self.announce_period = float(self.server["announce_period"])
        self.expiration = float(self.server["expiration"])
        self.update_period = float(self.client["update_period"])
        self.max_stall = float("inf")  # corolla gives up after max_retries instead

    # ------------------------------------------------------------------ server
    def announced_throughput(self, cost: StepCost, speed: float, blocks: int) -> float:
        """Single-token decode steps per second through one block (server.presence.throughput)."""
        return 1.0 / cost.decode_seconds(1, speed)

    def placement_share(self, throughput: float, start: int, end: int) -> float:
        return rebalancing.block_share(throughput, start, end)

    def join_delay(self, rng: random.Random) -> float:
        return rebalancing.join_delay(rng, self.server["join_delay"])

    def choose(self, capacity: Sequence[float], blocks: int, rng: random.Random) -> tuple[int, int]:
        return choose_joining_blocks(blocks, capacity, rng)

    def settle_delay(self, rng: random.Random) -> float | None:
        return rng.uniform(0.0, self.server["settle_delay"])

    def settle(self, me: str, current: tuple[int, int], share: float, capacity: Sequence[float],
               joining_here: Mapping[str, tuple[int, int, float]]) -> tuple[int, int] | None:
        return rebalancing.settle_move(me, current, share, capacity, joining_here, self.server["balance_quality"])

    def watch_period(self, holders: Sequence[int]) -> float | None:
        return self.server["watch_period"] if rebalancing.needs_watch(holders) else None

    def check_delay(self, rng: random.Random) -> float:
        return rebalancing.check_delay(rng, self.server["balance_period"])

    def plan(self, current: tuple[int, int], share: float, capacity: Sequence[float], since_last_move: float,
             rng: random.Random, swarm: SwarmSpans) -> Move | None:
        return rebalancing.plan_move(current, share, capacity, self.server["balance_quality"], since_last_move,
                                     self.server["move_cooldown"])

    def stagger(self, rng: random.Random, move: Move) -> float:
        return rng.uniform(0.0, self.server["move_stagger"] / (10.0 if move.urgent else 1.0))

    def drain(self, move: Move) -> float:
        return rebalancing.drain_seconds(move, self.server["drain_timeout"])

    # ------------------------------------------------------------------ client
    def snapshot(self, dht: SimDht) -> list[dict[str, ServerInfo]]:
        return dht.block_servers()

    def index(self, snapshot: list[dict[str, ServerInfo]], need: int, rtts: Mapping[str, float],
              blocks: int) -> RouteIndex:
        return route_index(snapshot, 0, blocks, cache_tokens_needed=need, hop_cost=self.client["hop_cost"], rtts=rtts,
                           default_rtt=self.client["default_rtt"])

    def route(self, index: RouteIndex, start: int, end: int, rng: random.Random,
              banned: Collection[str]) -> list[Span] | None:
        # push routes, the client's default (ClientConfig.push); simulated servers announce no next_pings, so a
        # server-to-server leg is priced through the client, as a real client prices servers that measured none
        return find_route_in(index, start, end, push=True, rng=rng, banned=banned)

    def ban(self, previous: Ban | None, now: float, unreachable: bool) -> Ban:
        c = self.client
        return next_ban(previous, now, c["min_backoff"], c["max_backoff"], unreachable, c["unreachable_ban"])

    def retry_delay(self, failures: int) -> float:
        return retry_delay(failures, self.client["min_backoff"])

    def gives_up(self, failures: int) -> bool:
        return failures > self.client["max_retries"]


def make_policy(name: str) -> Policy:
    if name == "corolla":
        return CorollaPolicy()
    if name == "petals":
        from corolla.sim.petals import PetalsPolicy

        return PetalsPolicy()
    raise ValueError(f"unknown policy {name!r}")
