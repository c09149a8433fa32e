"""`corolla status`: which servers hold which blocks, judged exactly as the monitor page judges them.

Both read the swarm with corolla.monitor.collect.collect_state: the DHT records, then an rpc_info ping to every
server, so a server that died shows as `unreachable` (and its blocks as uncovered) at once, although its record
stays in the DHT until it expires.

Each server's line ends with this user's spot-check record of it (ClientConfig.verify_rate): `checks P/F` (passed,
failed), `DISTRUSTED` when a client caught it lying, read from the clients' reputation file (client.trust.reputation);
`--json` adds it as "client_reputation" {peer id: record}. A record is what this machine's clients saw, not a
swarm-wide verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from corolla.cli.common import add_initial_peers_argument
from corolla.client.trust.reputation import load as load_reputation
from corolla.dht import model_dht_prefix
from corolla.membership import load_swarm_key
from corolla.monitor.collect import collect_state
from corolla.monitor.schema import ModelView, SwarmState
from corolla.monitor.source import join_swarm

PING_TIMEOUT = 3.0  # seconds a server has to answer before it counts as gone


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="show which servers hold which blocks",
        description="Read the DHT, ping every server and show each model's coverage and each server's blocks, state, "
                    "throughput, free cache and round trip. Without --model: every model announced in the swarm.",
    )
    add_initial_peers_argument(p, "multiaddrs of DHT peers of the swarm", required=True, default=None)
    p.add_argument("--model", default=None, help="model repo id or directory (its name is the DHT prefix)")
    p.add_argument("--dht-prefix", default=None, help="DHT namespace to read (default: from --model)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="blocks to scan (default: from the model's config or the swarm's model index, else 256)")
    p.add_argument("--json", action="store_true",
                   help="print JSON: with --model/--dht-prefix that model's view, else the whole swarm's "
                        "(the shape of the monitor's /api/v1/state)")
    p.add_argument("--swarm-key", default=None, help="private swarm: the swarm key file (`corolla swarm-key PATH`)")
    p.set_defaults(func=run, exit_at_once=True)


def run(args: argparse.Namespace) -> int:
    prefix = args.dht_prefix or (model_dht_prefix(args.model) if args.model else None)
    models = None if prefix is None else {prefix: args.num_blocks or _model_blocks(args.model)}
    state = asyncio.run(_collect(args.initial_peers, models, args.swarm_key))
    if prefix is not None:
        view = state.models[0]
        if args.json:
            print(json.dumps({**view.model_dump(mode="json"), "client_reputation": _reputation()}, indent=2))
        else:
            _print_model(view)
        return 0
    if args.json:
        print(
            json.dumps(
                {**state.model_dump(mode="json", exclude={"history"}), "client_reputation": _reputation()}, indent=2
            )
        )
        return 0
    if not state.models:
        print("no model is announced in this swarm")
    for view in state.models:
        _print_model(view)
    return 0


def _reputation() -> dict[str, dict[str, object]]:
    return {peer: vars(rec) for peer, rec in load_reputation().items()}


def _print_model(view: ModelView) -> None:
    reputation = load_reputation()
    health = "healthy" if view.healthy else "missing blocks " + ", ".join(view.missing_ranges)
    print(
        f"model {view.dht_prefix}: {view.num_blocks} blocks, {view.servers_online}/{len(view.servers)} server(s) "
        f"online, {health}"
    )
    if view.uncovered_blocks:
        print(f"blocks with no online server: {view.uncovered_blocks}")
    for s in view.servers:
        rtt = "-" if s.rtt_ms is None else f"{s.rtt_ms:.1f} ms"
        rec = reputation.get(s.peer_id)
        checks = (
            "" if rec is None else f"  checks {rec.passed}/{rec.failed}" + ("  DISTRUSTED" if rec.distrusted else "")
        )
        print(
            f"  {s.peer_id}  blocks {s.start_block}:{s.end_block}  {s.state:<11} {s.throughput:.1f} tok/s  "
            f"cache {s.cache_tokens_free}/{s.cache_tokens_total}  {s.torch_dtype}  quant {s.quant}  v{s.version}  "
            f"rtt {rtt}{checks}"
        )


def _model_blocks(model: str | None) -> int | None:
    if not model:
        return None
    try:
        from corolla.checkpoint import load_config
        from corolla.models import get_family

        config = load_config(model)
        return get_family(config).num_blocks(config)
    except (OSError, ValueError):
        return None


async def _collect(
    initial_peers: list[str], models: dict[str, int | None] | None, swarm_key_path: str | None = None
) -> SwarmState:
    node = await join_swarm(initial_peers, load_swarm_key(swarm_key_path) if swarm_key_path else None)
    try:
        return await collect_state(node, models=models, ping_timeout=PING_TIMEOUT)
    finally:
        await node.shutdown()
