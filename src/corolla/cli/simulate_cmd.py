"""`corolla simulate`: a whole swarm simulated on one machine by the product's own placement, rebalancing and
routing code (corolla.sim). Flags are generated from corolla.sim.scenario.Scenario; `--scenario FILE` reads a
scenario file first (speed classes, regions, round trips, fixed placements, another step-cost table), and flags
given on the command line override it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from corolla.cli.dataclass_args import add_dataclass_arguments

ROWS = (  # (label, JSON field, unit) of the table printed without --json
    ("served", "served_tokens_per_s", "tokens/s"),
    ("capacity bound", "capacity_bound_tokens_per_s", "tokens/s"),
    ("served / bound", "served_fraction_of_bound", ""),
    ("time per output token p50", "tpot_ms_p50", "ms"),
    ("time per output token p99", "tpot_ms_p99", "ms"),
    ("time to first token p50", "ttft_s_p50", "s"),
    ("admission wait p99", "admission_wait_s_p99", "s"),
    ("finished sessions", "finished_sessions", ""),
    ("failed sessions", "failed_sessions", ""),
    ("uncovered block-seconds", "uncovered_block_seconds", "block-s"),
    ("after the burst, uncovered blocks at most", "burst_uncovered_blocks_max", ""),
    ("after the burst, covered again after", "burst_recovery_s", "s"),
    ("moves per server-hour", "moves_per_server_hour", ""),
    ("mean decode batch", "mean_decode_batch", "sessions"),
    ("DHT bytes per server-minute", "dht_bytes_per_server_per_min", "bytes"),
    ("simulation wall time", "wall_s", "s"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from corolla.sim.scenario import FILE_ONLY, Scenario

    p = subparsers.add_parser(
        "simulate", help="simulate a swarm of many servers and clients (no network, deterministic)",
        description="Simulate a whole swarm (servers joining, moving and leaving; clients routing sessions, "
                    "failing over) on one machine, driven by corolla's own placement, rebalancing, routing, "
                    "failover, ban and cache-admission code, or by Petals' rules (--policy petals); prints a table "
                    "of what it measured, or with --json one object. Defaults: 1,000 servers of 3 speed classes in "
                    "4 regions, an 80-block model, a 2-hour median server lifetime and 10% of the servers leaving "
                    "at once half-way, one simulated hour (measured after --warmup).",
    )
    add_dataclass_arguments(p, Scenario, skip=FILE_ONLY)
    p.add_argument("--scenario", metavar="FILE", default=None,
                   help="read the scenario from this JSON (or .toml) file first; its keys are the flags' names "
                        "with underscores, plus classes, regions, rtt_ms, placements, decode_table, prefill_table")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from corolla.sim import simulate
    from corolla.sim.scenario import Scenario, from_mapping, load_file

    given = {name: getattr(args, name) for name in Scenario.__dataclass_fields__ if hasattr(args, name)}
    base = from_mapping(load_file(args.scenario)) if args.scenario else None
    scenario = from_mapping(given, base)
    result = simulate(scenario)
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result, scenario))
    return 0


def table(result: dict[str, Any], scenario: Any) -> str:
    head = (f"{scenario.servers} servers, {scenario.blocks} blocks, policy {scenario.policy}, "
            f"{'%d clients' % scenario.clients if scenario.clients else 'demand %g' % scenario.demand}, "
            f"{scenario.duration:g} s simulated (seed {scenario.seed})")
    width = max(len(label) for label, _, _ in ROWS)
    lines = [head]
    for label, key, unit in ROWS:
        value = result.get(key)
        shown = "-" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:,.3g}" \
            if isinstance(value, float) and abs(value) < 10 else f"{value:,.1f}" if isinstance(value, float) \
            else str(value)
        lines.append(f"  {label:<{width}}  {shown} {unit}".rstrip())
    return "\n".join(lines)
