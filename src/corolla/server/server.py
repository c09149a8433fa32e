"""The server process: load blocks, join the DHT, serve RPCs, announce, shut down cleanly.

Lifecycle:  JOINING (record announced, weights loading) -> ONLINE ("serving blocks A:B") -> OFFLINE on stop.
A server that chose its blocks itself waits a short random delay before choosing, settles them before loading,
and then checks every balance_period seconds (and at once when a block loses its last server) whether other blocks
would serve the swarm better; if so it goes OFFLINE for new sessions, drains the open ones, and goes through
JOINING -> ONLINE again for the new blocks (server.rebalancer, deciding with server.presence.rebalancing).
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import Callable

import torch

import corolla
from corolla.checkpoint import load_config
from corolla.dht import ModelRecord, SwarmNode, create_swarm_node, fetch_block_servers, model_dht_prefix
from corolla.models import get_family
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.codecs import CODECS
from corolla.membership import load_swarm_key
from corolla.protocol.messages import (MAX_LOAD_SESSIONS, MAX_MADDRS, MAX_STEP_SECONDS, InfoReply, ServerInfo,
                                       ServerState)
from corolla.server.loading.adapters import read_adapter_config
from corolla.server.presence.announcer import Announcer
from corolla.server.compute.block_stack import BlockStack
from corolla.server.loading.blocks import default_cache_tokens, default_num_blocks, load_stack
from corolla.server.presence import rebalancing
from corolla.server.presence.block_selection import choose_joining_blocks, parse_block_range
from corolla.server.presence.joining import join_with_retries
from corolla.server.presence.load import LoadMeter
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import PRIORITY_INFERENCE, ComputeWorker
from corolla.server.config import ServerConfig, public_model_name
from corolla.server.loading.dtype_choice import checkpoint_dtype_name, resolve_dtype
from corolla.server.rpc.faults import announced_quant
from corolla.server.rpc.handler import ConnectionHandler
from corolla.server.metrics import ServerMetrics
from corolla.server.rebalancer import Rebalancer
from corolla.server.speed import compute_throughput, network_tokens
from corolla.server.presence.next_hops import NextHops
from corolla.server.presence.network import announced_throughput
from corolla.models.quantization import check_quant_mode
from corolla.server.compute.tensor_parallel import check_tensor_parallel
from corolla.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

TASK_STOP_TIMEOUT = 10.0  # seconds the background tasks get to end once cancelled, at shutdown


class Server:
    """One server; `await Server(config).run()` serves until `stop()` is called or the task is cancelled."""

    def __init__(self, config: ServerConfig):
        check_quant_mode(config.quant)
        if not config.initial_peers and not config.new_swarm:
            raise ValueError("give --initial-peers of a running swarm, or --new-swarm to start one")
        if config.balance_period < 0 or config.balance_quality < 0:
            raise ValueError("--balance-period and --balance-quality must be >= 0")
        for knob in ("join_delay", "settle_delay", "move_stagger", "move_cooldown", "drain_timeout"):
            if not getattr(config, knob) >= 0:
                raise ValueError(f"--{knob.replace('_', '-')} must be >= 0 seconds, got {getattr(config, knob)}")
        if not config.watch_period > 0:
            raise ValueError(f"--watch-period must be > 0 seconds, got {config.watch_period}")
        if config.step_timeout <= 0 or config.session_timeout <= 0:
            raise ValueError("--step-timeout and --session-timeout must be > 0 seconds")
        if config.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {config.max_batch_size}")
        self.config = config
        self.device = torch.device(
            config.tensor_parallel_devices[0] if config.tensor_parallel_devices else config.device
        )
        self.model_config = load_config(config.model, cache_dir=config.cache_dir)
        self.dtype_name, self.dtype = resolve_dtype(config.dtype, checkpoint_dtype_name(self.model_config), self.device)
        self.bytes_per_block = 0  # resident bytes of one hosted block, measured once they load
        self.family = get_family(self.model_config)
        if config.tensor_parallel_devices:
            check_tensor_parallel(self.family, self.model_config, config.tensor_parallel_devices)
        self.num_model_blocks = self.family.num_blocks(self.model_config)
        for adapter in config.adapters:  # refuse an unsupported adapter before joining the swarm
            read_adapter_config(adapter, cache_dir=config.cache_dir)
        self.prefix = config.dht_prefix or model_dht_prefix(config.model)
        self.swarm_key = load_swarm_key(config.swarm_key) if config.swarm_key else None  # a bad file fails here
        self.state = ServerState.JOINING
        self.start_block = self.end_block = 0
        self.throughput = config.throughput or 0.0  # tokens/s per block; measured once the blocks load
        self.node: SwarmNode | None = None
        self.maddrs: tuple[str, ...] = ()  # where clients dial this server, announced in its record
        self.stack: BlockStack | None = None
        self.allocator: CacheAllocator | None = None
        self.handler: ConnectionHandler | None = None
        self.next_hops: NextHops | None = None  # round trips to the servers after ours, announced for push routing
        self.metrics = ServerMetrics()  # exported over HTTP only with --metrics-port
        self.load = LoadMeter(lambda: self.end_block - self.start_block)  # announced, for clients to spread
        self.rebalancer: Rebalancer | None = None  # when the server chose its blocks itself
        self.metrics.watch(
            lambda: len(self.handler.sessions) if self.handler else 0,
            lambda: self.allocator.budget if self.allocator else None,
        )
        self.on_online: list[Callable[[Server], None]] = []  # called each time the server goes ONLINE (after its
        # "serving blocks" line), e.g. by `corolla serve` to report readiness machine-readably
        self._stop = asyncio.Event()
        self._fault_armed = False  # SIGUSR1 came (--inject-fault): every handler of this server is armed

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ records
    def server_info(self) -> ServerInfo:
        budget = self.allocator.budget if self.allocator else None
        return ServerInfo(
            state=self.state,
            start_block=self.start_block,
            end_block=self.end_block,
            throughput=self.throughput,
            cache_tokens_total=budget.total if budget else 0,
            cache_tokens_free=budget.free if budget else 0,
            torch_dtype=self.dtype_name,
            quant=announced_quant(self.config.inject_fault, self.config.quant),
            bytes_per_block=self.bytes_per_block,
            version=corolla.__version__,
            protocol_version=PROTOCOL_VERSION,
            max_session_length=self.config.max_session_length,
            step_timeout=self.config.step_timeout,
            session_timeout=self.config.session_timeout,
            adapters=tuple(self.config.adapters),
            maddrs=self.maddrs[:MAX_MADDRS],
            relayed=self.node is not None and self.node.relayed,
            next_pings=self.next_hops.announced() if self.next_hops is not None else {},
            codecs=CODECS,
            sessions=min(len(self.handler.sessions), MAX_LOAD_SESSIONS) if self.handler else 0,
            standby_sessions=min(len(self.handler.table.standbys), MAX_LOAD_SESSIONS) if self.handler else 0,
            # sessions waiting for cache room (the allocator's queue; read-only here)
            queued=min(len(self.allocator._waiters), MAX_LOAD_SESSIONS) if self.allocator else 0,
            step_seconds=min(self.load.step_seconds(), MAX_STEP_SECONDS),
        )

    def info_reply(self) -> InfoReply:
        assert self.node is not None and self.handler is not None
        return InfoReply(
            peer_id=self.node.peer_id,
            info=self.server_info(),
            model=public_model_name(self.config.model),  # never this machine's checkpoint path
            dht_prefix=self.prefix,
            hidden_size=self.model_config.hidden_size,
            active_sessions=len(self.handler.sessions),
            decode_batches=self.handler.worker.batches_run,
            decode_steps=self.handler.worker.batched_tasks,
        )

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        worker = ComputeWorker(max_batch=self.config.max_batch_size, observe=self._observe_compute)
        announcer: Announcer | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            if self.config.metrics_port:
                self.metrics.start_http(self.config.host, self.config.metrics_port)
            if self.config.inject_fault:  # before "serving blocks": a SIGUSR1 sent on that line must not kill us
                asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self._arm_fault)
            self.node = await self._join()
            if self.config.new_swarm:
                logger.info("started a new swarm; others join it with --initial-peers %s", ",".join(self.maddrs))
            self.start_block, self.end_block = await self._choose_blocks()
            model = ModelRecord(num_blocks=self.num_model_blocks, model_type=str(self.model_config.model_type)[:64])
            announcer = Announcer(
                self.node.dht,
                self.prefix,
                self.node.peer_id,
                self.server_info,
                self.config.announce_period,
                self.config.expiration,
                model,
            )
            # a rejoin attempt (3 s of pings at most) at least once per announce period while cut off: the record is
            # back in the DHT within one period of the network's return
            max_backoff = max(self.config.rejoin_period, min(30.0, self.config.announce_period) - 3.0)
            watch = self.node.start_watch(self.config.rejoin_period, max_backoff)
            watch.on_rejoined.append(announcer.announce_soon)
            if not self.config.blocks:
                self.rebalancer = Rebalancer(self, announcer, worker)
            await self.serve_blocks(announcer, worker)
            tasks.append(asyncio.create_task(announcer.run()))
            self.next_hops = NextHops(self.node, self.prefix, self.num_model_blocks)
            serving_end = lambda: self.end_block if self.state == ServerState.ONLINE else None  # noqa: E731
            tasks.append(
                asyncio.create_task(
                    self.next_hops.run(self.config.announce_period, serving_end, announcer.refresh_soon)
                )
            )
            if self.config.balance_period > 0 and self.rebalancer is not None:
                tasks.append(asyncio.create_task(self.rebalancer.run()))
            await self._stop.wait()
        finally:
            await self._shutdown(announcer, tasks, worker)

    async def _join(self) -> SwarmNode:
        """Start this server's P2P node and DHT peer (identity, addresses, relays and swarm key as configured)."""
        config, begin = self.config, time.perf_counter()
        node = await join_with_retries(lambda: create_swarm_node(
            config.initial_peers,
            host=config.host,
            port=config.port,
            announce_maddrs=config.announce_maddrs,
            identity_path=config.identity,
            use_relay=config.use_relay,
            relays=config.relays,
            swarm_key=self.swarm_key,
        ), stopped=self._stop.is_set)
        self.maddrs = tuple(await node.maddrs())
        logger.info("joined the swarm as %s in %.2fs", node.peer_id, time.perf_counter() - begin)
        if node.relayed:
            logger.info("behind relays: clients reach this server at %s", " ".join(self.maddrs))
        return node

    def _observe_compute(self, fn: Callable[..., object], batch_size: int, latencies: list[float]) -> None:
        """The compute worker's observer (on its thread): metrics, and the load this server announces."""
        self.metrics.observe_compute(fn, batch_size, latencies)
        self.load.observe(fn, batch_size, latencies)

    def _arm_fault(self) -> None:
        """SIGUSR1 with --inject-fault: steps fail from now on (armed when the handler exists, if it does not yet)."""
        logger.warning("SIGUSR1: inference steps now %s (--inject-fault)", self.config.inject_fault)
        self._fault_armed = True
        if self.handler is not None:
            self.handler.arm_fault()

    async def serve_blocks(self, announcer: Announcer, worker: ComputeWorker) -> None:
        """JOINING -> load blocks start_block:end_block (settled first when the server chose them), open their cache
        and RPCs -> ONLINE ("serving blocks A:B")."""
        assert self.node is not None
        self.state = ServerState.JOINING
        await announcer.announce()  # others see the blocks are being taken
        if self.rebalancer is not None:
            await self.rebalancer.settle()  # another server may have taken the same blocks at the same moment
        self.stack = await asyncio.get_running_loop().run_in_executor(None, self._load_blocks)
        self.allocator = CacheAllocator(
            self._cache_tokens(), self.metrics, self.config.cache_queue_patience, self.config.max_peer_cache_share,
            lambda: worker.saturation.saturated(time.monotonic()),
        )
        if not self.throughput:
            compute = await worker.run(PRIORITY_INFERENCE, compute_throughput, self)
            network = await network_tokens(self)
            self.throughput = announced_throughput(compute, network, self.end_block - self.start_block)
        gate = self.node.gate
        self.handler = ConnectionHandler(
            self.stack,
            self.allocator,
            worker,
            self.config,
            self.info_reply,
            self.metrics,
            authorize=gate.authorize if gate is not None else None,
            key=self.node.key,
        )
        if self._fault_armed:
            self.handler.arm_fault()
        # pushes of many positions go deflated to next servers that announce it (as next_hops last read them)
        self.handler.parts.push_codecs = lambda peer: (
            self.next_hops.codecs_of(peer) if self.next_hops is not None else ("none",))
        await self.handler.register(self.node.p2p)
        self.state = ServerState.ONLINE
        self.metrics.describe(
            peer_id=self.node.peer_id,
            model=self.prefix,
            blocks=f"{self.start_block}:{self.end_block}",
            dtype=self.dtype_name,
            quant=self.config.quant,
            version=corolla.__version__,
        )
        await announcer.announce()
        logger.info(
            "serving blocks %d:%d of %s as %s (dht prefix %s, cache %d tokens, %.1f tokens/s per block) at %s",
            self.start_block,
            self.end_block,
            self.config.model,
            self.node.peer_id,
            self.prefix,
            self.allocator.budget.total,
            self.throughput,
            " ".join(self.maddrs),
        )
        for callback in self.on_online:
            callback(self)

    async def _leave_blocks(self, announcer: Announcer) -> None:
        """OFFLINE first, so that clients re-routing away from us do not pick us again; then end every session,
        each with a shutting_down reply that makes its client move it to another server."""
        await self.stop_taking_sessions(announcer)
        await self.end_sessions()

    async def stop_taking_sessions(self, announcer: Announcer) -> None:
        """Announce OFFLINE for our blocks and refuse new sessions; open ones go on."""
        self.state = ServerState.OFFLINE
        if self.handler is not None:
            self.handler.shutting_down = True
        try:
            # a periodic announce still in flight cannot undo this: the record with the later expiration wins
            await asyncio.wait_for(announcer.announce(), 5.0)
            logger.info("announced OFFLINE for blocks %d:%d", self.start_block, self.end_block)
        except Exception as e:
            logger.warning("could not announce OFFLINE: %r", e)

    async def end_sessions(self) -> None:
        """End every open session (each gets a shutting_down reply: its client moves it elsewhere)."""
        if self.handler is not None:
            sessions = list(self.handler.sessions.values())
            for task in sessions:
                task.cancel()
            await asyncio.wait(sessions, timeout=5.0) if sessions else None

    async def _shutdown(
        self, announcer: Announcer | None, tasks: list[asyncio.Task[None]], worker: ComputeWorker
    ) -> None:
        """Stop the background tasks, leave our blocks (OFFLINE, sessions moved away), then close the node and
        worker."""
        stuck = await cancel_and_wait(tasks, TASK_STOP_TIMEOUT)
        if stuck:
            logger.warning("%d background task(s) did not stop when cancelled (%s); shutting down without them",
                           len(stuck), ", ".join(task.get_name() for task in stuck))
        self.state = ServerState.OFFLINE
        if announcer is not None:
            await self._leave_blocks(announcer)
        if self.node is not None:
            await self.node.shutdown()
        worker.shutdown()
        self.metrics.stop_http()

    # ------------------------------------------------------------------ setup steps
    async def _choose_blocks(self) -> tuple[int, int]:
        if self.config.blocks:
            return parse_block_range(self.config.blocks, self.num_model_blocks)
        num = self.config.num_blocks or self._default_num_blocks()
        num = min(num, self.num_model_blocks)
        # servers started together must not all read the same view (they would all take the same blocks)
        rng = random.Random()
        await asyncio.sleep(rebalancing.join_delay(rng, self.config.join_delay))
        assert self.node is not None
        view = await fetch_block_servers(self.node.dht, self.prefix, range(self.num_model_blocks))
        capacity = rebalancing.swarm_capacity(view, self.node.peer_id)
        start, end = choose_joining_blocks(num, capacity, rng)
        logger.info("chose blocks %d:%d (swarm capacity per block: %s)", start, end, [round(c, 1) for c in capacity])
        return start, end

    def _default_num_blocks(self) -> int:
        return default_num_blocks(self.family, self.model_config, self.dtype, self.dtype_name, self.config.quant)

    def _load_blocks(self) -> BlockStack:
        stack, self.bytes_per_block = load_stack(
            self.config,
            self.family,
            self.model_config,
            self.start_block,
            self.end_block,
            self.dtype,
            self.dtype_name,
            self.device,
        )
        return stack

    def _cache_tokens(self) -> int:
        if self.config.cache_tokens is not None:
            return self.config.cache_tokens
        assert self.stack is not None
        return default_cache_tokens(self.stack, self.dtype, self.end_block - self.start_block)
