"""A swarm in this process, for fast tests of the client's chain, pass pipe, stepper and route opening.

Servers are the real thing minus their process and p2pd: each one loads its blocks as `corolla serve --blocks A:B`
does, behind a real ConnectionHandler (sessions, push with signed receipts, validation, the batching compute
worker), registered on an in-memory P2P (memory_p2p) under its own peer key. The client side is the real one too:
a SequenceManager whose view of the swarm is set here instead of read from a DHT (`manager.update` does nothing),
and real InferenceSessions over it. Nothing here sleeps or polls: a step is as fast as the blocks compute.

    swarm = InProcessSwarm(model_path, [(0, 2), (2, 4), (2, 4)])
    session = swarm.session(max_length=16)      # an InferenceSession over every block
    swarm.crash(peer_id)                        # the server vanishes, as a killed process does
    swarm.close()                               # every stream ended, workers stopped
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

import corolla
from corolla.checkpoint import load_config
from corolla.client.config import ClientConfig
from corolla.client.event_loop import run_sync
from corolla.client.session.inference_session import InferenceSession
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.models import get_family
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.codecs import CODECS
from corolla.protocol.messages import InfoReply, ServerInfo, ServerState
from corolla.protocol.signing import PeerKey
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.block_stack import BlockStack
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.loading.blocks import load_stack
from corolla.server.rpc.handler import ConnectionHandler
from memory_p2p import MemoryP2P

CACHE_TOKENS = 4096  # per server


@dataclass
class Server:
    """One in-process server: its key, blocks, cache, compute worker and handler."""

    key: PeerKey
    stack: BlockStack
    allocator: CacheAllocator
    worker: ComputeWorker
    handler: ConnectionHandler

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    def record(self) -> ServerInfo:
        """What it would announce (ONLINE, its blocks and free cache)."""
        budget = self.allocator.budget
        return ServerInfo(state=ServerState.ONLINE, start_block=self.stack.start, end_block=self.stack.end,
                          throughput=100.0, cache_tokens_total=budget.total, cache_tokens_free=budget.free,
                          torch_dtype="float32", version=corolla.__version__, protocol_version=PROTOCOL_VERSION,
                          max_session_length=1024, codecs=CODECS)


def start_server(p2p: MemoryP2P, model_path: str, start: int, end: int, **settings: object) -> Server:
    """Blocks start:end of the checkpoint, loaded as `corolla serve --blocks start:end` loads them, behind a
    ConnectionHandler registered on `p2p` under a new peer key (on the client's event loop, as Connection uses it).
    `settings`: ServerConfig fields."""
    config = ServerConfig(model=model_path, blocks=f"{start}:{end}", max_session_length=1024, **settings)
    model_config = load_config(model_path)
    stack, _ = load_stack(config, get_family(model_config), model_config, start, end, torch.float32, "float32",
                          torch.device("cpu"))
    key = PeerKey.generate()
    allocator, worker = CacheAllocator(config.cache_tokens or CACHE_TOKENS), ComputeWorker()
    server: Server

    def describe() -> InfoReply:
        return InfoReply(peer_id=key.peer_id, info=server.record(), model="inprocess", dht_prefix="inprocess",
                         hidden_size=stack.hidden_size, active_sessions=len(server.handler.sessions))

    handler = ConnectionHandler(stack, allocator, worker, config, describe=describe, key=key)
    server = Server(key, stack, allocator, worker, handler)
    run_sync(handler.register(p2p.peer(key.peer_id)))
    return server


class InProcessSwarm:
    """Servers over `ranges` of the checkpoint at `model_path`, and clients of them (see the module doc)."""

    def __init__(self, model_path: str, ranges: list[tuple[int, int]], **settings: object):
        self.model_path = model_path
        self.num_blocks = load_config(model_path).num_hidden_layers
        self.p2p = MemoryP2P(caller=PeerKey.generate().peer_id)
        self.servers: list[Server] = []
        self.crashed: set[str] = set()  # peer ids of servers that crashed
        try:
            for start, end in ranges:
                self.servers.append(start_server(self.p2p, model_path, start, end, **settings))
        except BaseException:
            self.close()
            raise

    def by_peer(self, peer_id: str) -> Server:
        return next(s for s in self.servers if s.peer_id == peer_id)

    def manager(self, **config: object) -> SequenceManager:
        """A client's sequence manager seeing every server not crashed (ClientConfig fields in `config`; no
        backoff sleeps)."""
        client = replace(ClientConfig(initial_peers=(), min_backoff=0.0), **config)
        node = SimpleNamespace(p2p=self.p2p, peer_id=self.p2p.caller.to_base58())
        manager = SequenceManager(node, "inprocess", self.num_blocks, client)  # type: ignore[arg-type]

        async def update(force: bool = False) -> None:  # the view: every live server, as just announced
            manager.block_servers = [
                {s.peer_id: s.record() for s in self.servers if s.stack.start <= b < s.stack.end
                 and s.peer_id not in self.crashed}
                for b in range(self.num_blocks)
            ]

        manager.update = update  # type: ignore[method-assign]
        run_sync(update())
        return manager

    def session(self, max_length: int = 32, batch_size: int = 1, manager: SequenceManager | None = None,
                **config: object) -> InferenceSession:
        """An InferenceSession over every block (a new manager with `config` unless one is given)."""
        return InferenceSession(manager or self.manager(**config), max_length, batch_size)

    def partition(self, peer_id: str, streams_open: bool = False) -> None:
        """The server's host is cut off: it keeps running, silent (clients see no error, only no answer); see
        MemoryP2P.partition for `streams_open`."""
        self.p2p.partition(peer_id, streams_open)

    def crash(self, peer_id: str) -> None:
        """The server vanishes at once, as a killed process does (clients find out when they next use it)."""
        self.crashed.add(peer_id)
        self.p2p.crash(peer_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """What every block computes for hidden (B, T, H) from position 0, without a cache: the reference."""
        x, block = hidden, 0
        while block < self.num_blocks:
            server = next(s for s in self.servers if s.stack.start == block)
            x = server.stack.forward(x, server.stack.start, server.stack.end)
            block = server.stack.end
        return x

    def caches_free(self, wait: float = 10.0) -> bool:
        """Every live server's whole cache is free (every session it had was closed), within `wait` seconds: a
        server releases a session's cache when its stream ends, a moment after the client closed it (on a loaded
        machine, more than a moment)."""
        deadline = time.monotonic() + wait
        while True:
            free = all(s.allocator.budget.free == s.allocator.budget.total
                       for s in self.servers if s.peer_id not in self.crashed)
            if free or time.monotonic() >= deadline:
                return free
            time.sleep(0.02)

    def push_frames_held(self) -> dict[str, int]:
        """Bytes of pushed frames each live server still holds (server.rpc.push_budget), once the steps running
        now have finished: {} when every frame was let go."""
        def held() -> dict[str, int]:
            return {s.peer_id: sum(s.handler.push_receiver.budget.held.values())
                    for s in self.servers if s.peer_id not in self.crashed and s.handler.push_receiver.budget.held}

        async def settled() -> dict[str, int]:
            for _ in range(100):  # a step's task lets its frame go once it has answered: a few loop turns later
                if not held():
                    break
                await asyncio.sleep(0.01)
            return held()

        return run_sync(settled())

    def close(self) -> None:
        """End every stream and stop every compute worker."""
        async def end() -> None:
            streams = list(self.p2p.streams)
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

        run_sync(end())
        for server in self.servers:
            server.worker.shutdown()


class InProcessModel:
    """What `generate` needs of a model (client.decoding.generation.GenerationModel), over an in-process swarm: the
    local HF model's embeddings, final norm and LM head, and sessions on the swarm's servers."""

    def __init__(self, swarm: InProcessSwarm, hf: torch.nn.Module, **config: object):
        self.swarm, self.hf = swarm, hf
        self.config, self.generation_config = hf.config, hf.generation_config
        self.manager = swarm.manager(**config)

    def open_session(self, max_length: int, batch_size: int = 1, *, standby: int | None = None) -> InferenceSession:
        return InferenceSession(self.manager, max_length, batch_size, standby=standby)

    def embed(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.hf.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.hf.lm_head(self.hf.model.norm(hidden))

    def generate(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        from corolla.client.decoding.generation import generate

        return generate(self, input_ids, **kwargs)
