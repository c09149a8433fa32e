"""What `corolla simulate` simulates: a frozen `Scenario`, from the command line, a scenario file, or both.

Every field has a default (the goals' scenario: 1,000 servers in 3 speed classes across 4 regions, an 80-block
model, servers living a median 2 hours, 10% of them leaving at once half-way, one hour) and a unit. The CLI is
generated from the flat fields (cli.dataclass_args); speed classes, regions, their round trips, fixed placements
and another step-cost table come from a file (JSON, or TOML by its .toml suffix) whose keys are the same names:

    {"servers": 6, "blocks": 6, "clients": 8, "churn": 0, "burst_fraction": 0.17, "burst_at": 120,
     "classes": [{"name": "cpu", "share": 1.0, "speed": 1.0, "blocks": 2, "cache_tokens": 16384}],
     "regions": [{"name": "lan", "servers": 1.0, "clients": 1.0}], "rtt_ms": [[20]]}

`validated` raises ValueError with one line saying what is wrong (negative counts, more blocks per server than
the model has, an impossible duration, shares that do not add up, unknown keys).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corolla.sim.step_cost import DECODE_BATCHES, DECODE_SECONDS, PREFILL_SECONDS, PREFILL_TOKENS, StepCost

POLICIES = ("corolla", "petals")


def _opt(help: str, **kw: object) -> dict[str, object]:
    return {"help": help, **kw}


@dataclass(frozen=True)
class SpeedClass:
    """Servers of one kind of hardware."""

    name: str
    share: float  # fraction of the servers
    speed: float  # how much faster than the measured block (corolla.sim.step_cost) it runs a block: 2.0 = twice
    blocks: int  # blocks each server of it holds (what fits in its memory)
    cache_tokens: int  # its KV-cache budget over all of its blocks, tokens (batch rows x positions)


@dataclass(frozen=True)
class Region:
    """Where servers and clients are: `servers` and `clients` are the fractions of each that are there."""

    name: str
    servers: float
    clients: float


DEFAULT_CLASSES = (
    SpeedClass("fast", 0.2, 2.0, 16, 327_680),
    SpeedClass("medium", 0.4, 1.0, 10, 245_760),
    SpeedClass("slow", 0.4, 0.5, 6, 163_840),
)
DEFAULT_REGIONS = (
    Region("us-east", 0.35, 0.35),
    Region("us-west", 0.20, 0.20),
    Region("europe", 0.30, 0.30),
    Region("asia", 0.15, 0.15),
)
DEFAULT_RTT_MS = (  # between regions' data centres, round trip; each host adds its own access latency (access_ms)
    (10.0, 65.0, 80.0, 180.0),
    (65.0, 10.0, 140.0, 110.0),
    (80.0, 140.0, 10.0, 220.0),
    (180.0, 110.0, 220.0, 10.0),
)


@dataclass(frozen=True)
class Scenario:
    servers: int = field(
        default=1000, metadata=_opt("servers in the swarm (they join over the first --join-period seconds)")
    )
    blocks: int = field(default=80, metadata=_opt("transformer blocks of the model"))
    demand: float = field(
        default=0.5,
        metadata=_opt("sessions arrive asking for this many times the capacity bound in tokens/s (0.5: half load, "
                      "2: saturated); ignored with --clients"),
    )
    duration: float = field(default=3600.0, metadata=_opt("simulated seconds"))
    policy: str = field(
        default="corolla",
        metadata=_opt("placement, rebalancing and routing rules: corolla's own code, or Petals 2.2's rules",
                      choices=POLICIES),
    )
    seed: int = field(default=0, metadata=_opt("random seed: equal seeds give equal results"))
    clients: int = field(
        default=0,
        metadata=_opt("if > 0: this many clients, each running one session after another (closed loop), instead "
                      "of sessions arriving at --demand"),
    )
    join_period: float = field(default=300.0, metadata=_opt("seconds over which the servers join, at random"))
    warmup: float = field(
        default=900.0,
        metadata=_opt("metrics count what happens after this many seconds (the servers have joined and the "
                      "sessions running at once have built up)"),
    )
    churn: float = field(
        default=7200.0,
        metadata=_opt("median server lifetime, seconds (lognormal); each leaver is replaced after --rejoin-delay; "
                      "0 = servers never leave"),
    )
    churn_sigma: float = field(default=1.0, metadata=_opt("spread of server lifetimes (sigma of their logarithm)"))
    crash_fraction: float = field(
        default=0.5, metadata=_opt("fraction of departures that are crashes (no OFFLINE announced)")
    )
    rejoin_delay: float = field(default=60.0, metadata=_opt("seconds before a departed server is replaced"))
    burst_at: float = field(default=1800.0, metadata=_opt("when a burst of servers leaves at once, seconds"))
    burst_fraction: float = field(
        default=0.1, metadata=_opt("fraction of the servers that leave (crash) in the burst; 0 = no burst")
    )
    burst_region: str | None = field(
        default=None, metadata=_opt("the burst takes servers of this region only (default: from every region)")
    )
    burst_return: float = field(
        default=600.0, metadata=_opt("seconds after the burst its servers come back; 0 = they never do")
    )
    prompt_min: int = field(default=32, metadata=_opt("shortest prompt, tokens (uniform up to --prompt-max)"))
    prompt_max: int = field(default=128, metadata=_opt("longest prompt, tokens"))
    new_tokens_min: int = field(default=128, metadata=_opt("fewest tokens a session generates (uniform)"))
    new_tokens_max: int = field(default=896, metadata=_opt("most tokens a session generates"))
    access_ms: float = field(
        default=5.0, metadata=_opt("mean access latency each host adds to its round trips, ms (uniform 0..2x)")
    )
    hop_overhead: float = field(
        default=0.002, metadata=_opt("seconds a step spends in a server outside compute (framing, scheduling)")
    )
    client_overhead: float = field(
        default=0.005, metadata=_opt("seconds a client spends per token (embedding, head, sampling)")
    )
    load_seconds_per_block: float = field(default=2.0, metadata=_opt("seconds a server takes to load one block"))
    tick: float = field(
        default=1.0, metadata=_opt("seconds between updates of the fluid decode model (corolla.sim.fluid)")
    )
    classes: tuple[SpeedClass, ...] = DEFAULT_CLASSES
    regions: tuple[Region, ...] = DEFAULT_REGIONS
    rtt_ms: tuple[tuple[float, ...], ...] = DEFAULT_RTT_MS
    placements: tuple[tuple[int, int], ...] = ()  # fixed [start, end) of the first servers (as --blocks A:B)
    decode_table: tuple[tuple[float, float], ...] = tuple(zip(DECODE_BATCHES, DECODE_SECONDS))
    prefill_table: tuple[tuple[float, float], ...] = tuple(zip(PREFILL_TOKENS, PREFILL_SECONDS))

    def step_cost(self) -> StepCost:
        return StepCost(self.decode_table, self.prefill_table)


FILE_ONLY = ("classes", "regions", "rtt_ms", "placements", "decode_table", "prefill_table")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"bad scenario: {message}")


def validated(s: Scenario) -> Scenario:
    """`s` if it describes a swarm that can be simulated; else ValueError("bad scenario: <what is wrong>")."""
    _check(s.servers >= 1, f"servers must be >= 1, got {s.servers}")
    _check(s.blocks >= 1, f"blocks must be >= 1, got {s.blocks}")
    _check(math.isfinite(s.demand) and s.demand >= 0, f"demand must be >= 0, got {s.demand}")
    _check(s.clients >= 0, f"clients must be >= 0, got {s.clients}")
    _check(s.clients > 0 or s.demand > 0, "no load: give --demand > 0 or --clients > 0")
    _check(s.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}, got {s.policy!r}")
    _check(math.isfinite(s.duration) and 0 < s.duration <= 7 * 24 * 3600,
           f"duration must be within (0, 1 week] seconds, got {s.duration}")
    _check(0 <= s.warmup < s.duration, f"warmup must be within [0, duration), got {s.warmup} of {s.duration}")
    _check(0 <= s.join_period <= s.duration, f"join_period must be within [0, duration], got {s.join_period}")
    _check(0 < s.tick <= min(10.0, s.duration), f"tick must be within (0, 10] seconds and the duration, got {s.tick}")
    for name in ("churn", "churn_sigma", "rejoin_delay", "burst_at", "burst_return", "access_ms", "hop_overhead",
                 "client_overhead", "load_seconds_per_block"):
        value = getattr(s, name)
        _check(math.isfinite(value) and value >= 0, f"{name} must be >= 0, got {value}")
    for name in ("crash_fraction", "burst_fraction"):
        _check(0 <= getattr(s, name) <= 1, f"{name} must be within [0, 1], got {getattr(s, name)}")
    _check(1 <= s.prompt_min <= s.prompt_max, f"prompts need 1 <= prompt_min <= prompt_max, got {s.prompt_min}, "
           f"{s.prompt_max}")
    _check(2 <= s.new_tokens_min <= s.new_tokens_max,
           f"sessions need 2 <= new_tokens_min <= new_tokens_max, got {s.new_tokens_min}, {s.new_tokens_max}")
    _check(len(s.classes) >= 1 and len(s.regions) >= 1, "needs at least one speed class and one region")
    for c in s.classes:
        _check(c.share >= 0 and c.speed > 0, f"class {c.name}: share must be >= 0 and speed > 0")
        _check(1 <= c.blocks <= s.blocks, f"class {c.name}: {c.blocks} blocks per server, but the model has "
               f"{s.blocks}")
        _check(c.cache_tokens >= s.prompt_max + s.new_tokens_max,
               f"class {c.name}: cache_tokens {c.cache_tokens} cannot hold one session of "
               f"{s.prompt_max + s.new_tokens_max} tokens")
    _check(abs(sum(c.share for c in s.classes) - 1) < 1e-6, "speed classes' shares must add up to 1")
    _check(abs(sum(r.servers for r in s.regions) - 1) < 1e-6, "regions' server shares must add up to 1")
    _check(abs(sum(r.clients for r in s.regions) - 1) < 1e-6, "regions' client shares must add up to 1")
    _check(len(s.rtt_ms) == len(s.regions) and all(len(row) == len(s.regions) for row in s.rtt_ms),
           "rtt_ms must be a square matrix, one row per region")
    _check(all(v >= 0 and math.isfinite(v) for row in s.rtt_ms for v in row), "round trips must be >= 0 ms")
    _check(s.burst_region is None or s.burst_region in {r.name for r in s.regions},
           f"burst_region {s.burst_region!r} is not a region")
    _check(len(s.placements) <= s.servers, "more placements than servers")
    for start, end in s.placements:
        _check(0 <= start < end <= s.blocks, f"placement {start}:{end} is outside the model's {s.blocks} blocks")
    s.step_cost()  # raises on a bad table
    return s


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def from_mapping(data: dict[str, Any], base: Scenario | None = None) -> Scenario:
    """A Scenario from a file's or the CLI's keys (over `base`, default: the defaults), validated."""
    known = {f.name for f in dataclasses.fields(Scenario)}
    unknown = sorted(set(data) - known)
    _check(not unknown, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    try:
        for key, value in data.items():
            if key == "classes":
                values[key] = tuple(SpeedClass(**c) for c in value)
            elif key == "regions":
                values[key] = tuple(Region(**r) for r in value)
            else:
                values[key] = _tupled(value)
    except TypeError as e:
        raise ValueError(f"bad scenario: {e}") from None
    return validated(dataclasses.replace(base or Scenario(), **values))


def load_file(path: str | Path) -> dict[str, Any]:
    """The keys of a scenario file (JSON, or TOML for a .toml file); ValueError for a file that does not parse."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read scenario file {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"scenario file {path} does not parse: {e}") from None
    _check(isinstance(data, dict), f"scenario file {path} must hold one object of keys")
    return data
