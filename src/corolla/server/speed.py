"""What a server measures about its own speed before announcing it: compute (single-token steps per second through
one block, cached per shape, device and dtype) and network (bandwidth against other servers, cached a day)."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import torch

from corolla.dht import fetch_block_servers
from corolla.protocol.messages import ServerState
from corolla.server.compute.tensor_parallel import measure_throughput
from corolla.server.presence.network import measure_bandwidth, network_tokens_per_second
from corolla.server.presence.throughput import cached_throughput, load_cached, measure_block_throughput, store_cached

if TYPE_CHECKING:
    from corolla.server.server import Server

logger = logging.getLogger(__name__)

NETWORK_CACHE_KEY = {"measurement": "network bandwidth, bytes/s"}
NETWORK_CACHE_MAX_AGE = 24 * 3600.0  # seconds a measured bandwidth is trusted


async def network_tokens(server: Server) -> float | None:
    """Tokens/s this server's network carries (one hidden state each way per token); None if unknown.

    `--network-bandwidth` overrides the measurement. Otherwise the bandwidth measured against up to three
    other servers of the swarm is cached on disk for a day; the first server of a swarm has nobody to
    measure against, and its announced throughput is its compute alone.
    """
    assert server.node is not None
    if server.config.network_bandwidth is not None:
        bandwidth = server.config.network_bandwidth * 1e6 / 8
    else:
        bandwidth = load_cached(NETWORK_CACHE_KEY, max_age=NETWORK_CACHE_MAX_AGE)
        if bandwidth is None:
            servers = await fetch_block_servers(server.node.dht, server.prefix, range(server.num_model_blocks))
            peers = {
                peer
                for by_peer in servers
                for peer, info in by_peer.items()
                if peer != server.node.peer_id and info.state == ServerState.ONLINE
            }
            bandwidth = await measure_bandwidth(server.node.p2p, random.sample(sorted(peers), len(peers)))
            if bandwidth is None:
                logger.info("network: no other server to measure against; throughput counts compute only")
                return None
            store_cached(NETWORK_CACHE_KEY, bandwidth)
    tokens = network_tokens_per_second(bandwidth, server.model_config.hidden_size, server.dtype)
    logger.info("network: %.0f Mbit/s, %.0f tokens/s of hidden states", bandwidth * 8 / 1e6, tokens)
    return tokens


def compute_throughput(server: Server) -> float:
    """Single-token decode steps per second through one hosted block, measured once per model shape, device and
    dtype and cached on disk (server.presence.throughput). Runs on the compute thread."""
    assert server.stack is not None
    layout = server.stack.layout
    key = {
        "model_type": server.model_config.model_type,
        "hidden": server.model_config.hidden_size,
        "intermediate": getattr(server.model_config, "intermediate_size", None),
        "kv": [layout.n_kv_heads, layout.head_dim],
        "device": str(server.device),
        "dtype": server.dtype_name,
        "threads": torch.get_num_threads(),
        **({"quant": server.config.quant} if server.config.quant != "none" else {}),  # unquantized keys stay as before
    }
    if server.config.tensor_parallel_devices:
        key["tensor_parallel_devices"] = list(server.config.tensor_parallel_devices)
        return cached_throughput(key, lambda: measure_throughput(server.stack))
    return cached_throughput(
        key,
        lambda: measure_block_throughput(
            server.stack.blocks[0],
            server.stack.hidden_size,
            layout.n_kv_heads,
            layout.head_dim,
            server.dtype,
            server.device,
        ),
    )
