"""`corolla status`: which servers hold which blocks of a model."""

from __future__ import annotations

import argparse
import asyncio
import json

from corolla.dht import create_swarm_node, fetch_block_servers, model_dht_prefix
from corolla.membership import SwarmKey, load_swarm_key


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="show which servers hold which blocks",
                              description="Read the DHT and show each server's blocks, state, throughput and free cache.")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of DHT peers of the swarm")
    p.add_argument("--model", default=None, help="model repo id or directory (its name is the DHT prefix)")
    p.add_argument("--dht-prefix", default=None, help="DHT namespace to read (default: from --model)")
    p.add_argument("--num-blocks", type=int, default=None, help="blocks to scan (default: from the model's config, else 256)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--swarm-key", default=None, help="private swarm: the swarm key file (`corolla swarm-key PATH`)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.model and not args.dht_prefix:
        raise SystemExit("corolla status: give --model MODEL (or --dht-prefix PREFIX)")
    prefix = args.dht_prefix or model_dht_prefix(args.model)
    known_blocks = args.num_blocks or _model_blocks(args.model)
    swarm_key = load_swarm_key(args.swarm_key) if args.swarm_key else None
    report = asyncio.run(_collect(args.initial_peers, prefix, known_blocks, swarm_key))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model {report['dht_prefix']}: {report['num_blocks']} blocks, {len(report['servers'])} server(s)")
    if report["uncovered_blocks"]:
        print(f"blocks with no online server: {report['uncovered_blocks']}")
    for s in report["servers"]:
        print(f"  {s['peer_id']}  blocks {s['start_block']}:{s['end_block']}  {s['state']:<8} "
              f"{s['throughput']:.1f} tok/s  cache {s['cache_tokens_free']}/{s['cache_tokens_total']}  {s['torch_dtype']}  quant {s.get('quant', 'none')}  v{s['version']}"
              f"{'  via relay' if s.get('relayed') else ''}")
    return 0


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


async def _collect(initial_peers: list[str], prefix: str, known_blocks: int | None,
                   swarm_key: SwarmKey | None = None) -> dict[str, object]:
    """Read every block's records; without a known block count, scan 256 keys and stop at the last one found."""
    num_blocks = known_blocks or 256
    node = await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        per_block = await fetch_block_servers(node.dht, prefix, range(num_blocks))
    finally:
        await node.shutdown()
    servers: dict[str, dict[str, object]] = {}
    for by_peer in per_block:
        for peer, info in by_peer.items():
            servers[peer] = {"peer_id": peer, **info.model_dump(mode="json")}
    total = known_blocks or max([i + 1 for i, by_peer in enumerate(per_block) if by_peer] or [0])
    uncovered = [b for b in range(total) if not any(i.state.value == "online" for i in per_block[b].values())]
    return {
        "dht_prefix": prefix,
        "num_blocks": total,
        "servers": sorted(servers.values(), key=lambda s: (s["start_block"], s["peer_id"])),
        "uncovered_blocks": uncovered,
    }
