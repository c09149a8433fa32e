"""A storing node's checks of the writers whose records it keeps (dht.admission ranks records by them).

For every writer of a record it stores, a node asks the writer itself what it serves (one rpc_info, dht.info, over
the connection the writer just stored through) and remembers the answer for VERIFIED_TTL seconds: the keys it serves
are the block keys "{prefix}.{b}" of its announced range and the model index. A writer that does not answer, or
answers with a range of more than MAX_VERIFIED_BLOCKS blocks, is FAILED for FAILED_RETRY seconds. Checks run in the
background, CONCURRENT_CHECKS at once, at most MAX_PENDING waiting (more are dropped: a later store asks again),
each bounded by CHECK_TIMEOUT; what the node remembers is bounded by MAX_REMEMBERED writers (least recent dropped).

What it costs an honest server: one rpc_info answer per storing node of its keys per VERIFIED_TTL, and its records
rank UNKNOWN, not VERIFIED, for the first moments (they are stored and answered all the same).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from hivemind.dht.routing import DHTID

from corolla.dht.admission import FAILED, UNKNOWN, VERIFIED
from corolla.protocol.messages import InfoReply

logger = logging.getLogger(__name__)

VERIFIED_TTL = 600.0  # seconds a writer's answer counts before it is asked again
FAILED_RETRY = 60.0  # seconds before a writer that did not answer is asked again
CHECK_TIMEOUT = 3.0  # seconds one check may take (stream opening included)
CONCURRENT_CHECKS = 8
MAX_PENDING = 4096  # checks waiting to run
MAX_REMEMBERED = 65536  # writers whose answers are remembered
MAX_VERIFIED_BLOCKS = 4096  # a range wider than this is no server's (dht.model_index.MAX_INDEXED_BLOCKS)
INDEX_KEY = "_corolla.models"  # dht.model_index.MODEL_INDEX_KEY (not imported: model_index reads through lookup)


def served_keys(reply: InfoReply) -> frozenset[DHTID] | None:
    """The DHT keys a server that answered `reply` serves: its block keys and the model index; None if its range is
    wider than any server's."""
    info = reply.info
    if info.end_block - info.start_block > MAX_VERIFIED_BLOCKS or not reply.dht_prefix:
        return None
    keys = {DHTID.generate(source=f"{reply.dht_prefix}.{block}") for block in range(info.start_block, info.end_block)}
    keys.add(DHTID.generate(source=INDEX_KEY))
    return frozenset(keys)


class RecordVerifier:
    """Ranks of writers' records at one storing node; `ask(peer)` is an rpc_info to that peer (dht.info.ask_info)."""

    def __init__(self, ask: Callable[[str], Awaitable[InfoReply]], own_peer_id: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.ask = ask
        self.own_peer_id = own_peer_id  # this node's own records need no check
        self.clock = clock
        self._served: OrderedDict[str, tuple[float, frozenset[DHTID]]] = OrderedDict()  # peer -> (when, keys)
        self._failed: OrderedDict[str, float] = OrderedDict()  # peer -> when its check failed
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._running: set[asyncio.Task[None]] = set()
        self._checking: set[str] = set()  # peers whose check is running
        self.checks = 0  # checks completed (for tests and logs)

    def rank(self, peer: str, key: DHTID) -> int:
        """VERIFIED if `peer` answered lately that it serves `key`, FAILED if it did not answer or serves other keys,
        else UNKNOWN."""
        if peer == self.own_peer_id:
            return VERIFIED
        now = self.clock()
        served = self._served.get(peer)
        if served is not None and now - served[0] < VERIFIED_TTL:
            return VERIFIED if key in served[1] else FAILED
        failed = self._failed.get(peer)
        if failed is not None and now - failed < FAILED_RETRY:
            return FAILED
        return UNKNOWN

    def fresh(self, peer: str) -> bool:
        """Whether `peer`'s last check still counts (no new one is needed)."""
        now = self.clock()
        served, failed = self._served.get(peer), self._failed.get(peer)
        return (peer == self.own_peer_id or (served is not None and now - served[0] < VERIFIED_TTL)
                or (failed is not None and now - failed < FAILED_RETRY))

    def request(self, peer: str) -> None:
        """Check `peer` in the background unless its last check still counts or one is queued (needs a running event
        loop; without one, nothing happens: the node is not serving yet)."""
        if (self.fresh(peer) or peer in self._pending or peer in self._checking
                or len(self._pending) >= MAX_PENDING):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._pending[peer] = None
        self._start()

    def _start(self) -> None:
        while self._pending and len(self._running) < CONCURRENT_CHECKS:
            peer, _ = self._pending.popitem(last=False)
            self._checking.add(peer)
            task = asyncio.create_task(self._check(peer))
            self._running.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._start()

    async def _check(self, peer: str) -> None:
        try:
            reply = await asyncio.wait_for(self.ask(peer), CHECK_TIMEOUT)
            keys = served_keys(reply) if reply.peer_id == peer else None
        except Exception as e:  # unreachable, no corolla server there, garbage: all the same to a storing node
            logger.debug("record writer %s did not answer: %r", peer, e)
            keys = None
        finally:  # (cancelled too: the node is shutting down)
            self._checking.discard(peer)
        self.checks += 1
        if keys is None:
            self._remember(self._failed, peer, self.clock())
            self._served.pop(peer, None)
        else:
            self._remember(self._served, peer, (self.clock(), keys))
            self._failed.pop(peer, None)

    @staticmethod
    def _remember(table: OrderedDict, peer: str, value: object) -> None:
        table[peer] = value
        table.move_to_end(peer)
        while len(table) > MAX_REMEMBERED:
            table.popitem(last=False)
