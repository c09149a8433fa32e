"""One P2P daemon and one DHT node living in the caller's asyncio loop.

hivemind's `DHT` class forks a process per node; we run `DHTNode` in our own loop instead, so a server or client
is one Python process (plus the p2pd daemon hivemind spawns, which shares our process group).

How a node meets the network (all off the defaults' path to the internet: no IPFS bootstrap, no UPnP):
- `identity_path`: the node's private key file (created, mode 0600, when missing), so its peer id and multiaddr
  survive restarts;
- `host`/`port` are where it listens; `announce_maddrs` where others should dial it when that differs (a public
  address with a forwarded port). Listening on 0.0.0.0 announces the interfaces' addresses, never 0.0.0.0;
- `use_relay`: dial peers through libp2p circuit relays when they announce relayed addresses;
  `relay_service`: be such a relay for others (this node must be publicly reachable);
  `relays`: this node accepts no inbound connections (behind a NAT): reserve a relayed address at these public
  peers and announce it (see the README, "Across real networks", for what the bundled p2pd needs for that). Such a
  node's DHT runs in client mode: it asks and stores, but is not put in others' routing tables, where every lookup
  that chose it would wait out a timeout dialling it;
- `swarm_key`: a private swarm: every DHT RPC is MAC'ed with the key, and the node answers membership challenges
  (see corolla.membership); `node.gate.authorize(peer_id)` tells whether a peer holds the key.

Every node, whatever its role, holds DHT records by corolla's rules: records signed by and bound to their writer's
peer id (dht.signed_records, as hivemind's record validator), kept by dht.record_storage (no plain values, bounded
expirations, replays never cut a newer record short, only records their own writers send, a bounded number of writers
per key admitted and answered by rank: dht.admission, dht.verifier), read by dht.lookup.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from corolla.dht.identity import ephemeral_identity, load_or_create_identity
from corolla.dht.maddrs import circuit_maddrs, dialable, peer_id_of, to_daemon_bytes
from corolla.dht.admission import ANSWER_RECORDS
from corolla.dht.info import ask_info
from corolla.dht.listen_backlog import deepen_listen_backlog
from corolla.dht.lookup import LOOKUP_WORKERS
from corolla.dht.record_storage import (ANSWERING, CACHE_KEYS, MAX_SUBKEYS_PER_KEY, STORE_SENDER, RecordStorage,
                                        adopt)
from corolla.dht.verifier import CHECK_TIMEOUT, RecordVerifier
from corolla.dht.signed_records import SignedRecordValidator
from corolla.dht.watch import SwarmWatch
from corolla.membership import MembershipGate, SwarmKey, SwarmKeyAuthorizer, serve_proofs
from corolla.protocol.signing import PeerKey

logger = logging.getLogger(__name__)

DHT_SHUTDOWN_TIMEOUT = 5.0  # seconds
CONNECT_TIMEOUT = 10.0  # seconds one explicit dial may take


@dataclass(eq=False)
class SwarmNode:
    p2p: P2P
    dht: DHTNode
    key: PeerKey  # this node's private key (its peer id's): signs its DHT records and its pushes
    initial_peers: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()  # relays this node reserved a slot at (it is reachable only through them)
    gate: MembershipGate | None = None  # set in a private swarm
    watch: SwarmWatch | None = None
    verifier: RecordVerifier | None = None  # this node's checks of the writers of records it stores (dht.verifier)
    _watch_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def peer_id(self) -> str:
        """This node's peer id in base58 (the DHT subkey under which a server announces itself)."""
        return self.p2p.peer_id.to_base58()

    @property
    def initial_peer_ids(self) -> dict[str, str]:
        """Initial peer multiaddr -> its peer id."""
        return {m: p for m in self.initial_peers if (p := peer_id_of(m)) is not None}

    @property
    def relayed(self) -> bool:
        """True when other peers can reach this node only through relays."""
        return bool(self.relays)

    async def maddrs(self) -> list[str]:
        """Full multiaddrs other peers can dial, each ending in /p2p/<peer id>, best first: relayed addresses for a
        node behind relays, else the announced or interface addresses (loopback only when there is nothing else)."""
        if self.relays:
            return circuit_maddrs(self.relays, self.peer_id)
        return dialable(str(m) for m in await self.p2p.get_visible_maddrs(latest=True))

    async def connect(self, peer_id: str, maddrs: Sequence[str], timeout: float = CONNECT_TIMEOUT) -> bool:
        """Dial `peer_id` at `maddrs` (e.g. through a relay) unless already connected; see `dial`."""
        return await dial(self.p2p, peer_id, maddrs, timeout)

    def start_watch(self, period: float = 5.0, max_backoff: float = 30.0) -> SwarmWatch:
        """Keep this node joined through network outages (see dht.watch); stopped by shutdown()."""
        if self.watch is None:
            self.watch = SwarmWatch(self, period, max_backoff)
            self._watch_task = asyncio.create_task(self.watch.run())
        return self.watch

    async def shutdown(self) -> None:
        """Stop the watch, the DHT node and the p2pd daemon; safe to call twice.

        The DHT node's shutdown never returns once p2pd is gone (e.g. a SIGTERM sent to the whole process group
        reached it first), so it gets a few seconds, and p2pd is shut down in any case.
        """
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None
        try:
            await asyncio.wait_for(self.dht.shutdown(), DHT_SHUTDOWN_TIMEOUT)
        except asyncio.TimeoutError:
            logger.warning("the DHT node did not stop within %.0fs (p2pd already gone?)", DHT_SHUTDOWN_TIMEOUT)
        finally:
            await self.p2p.shutdown()


async def dial(p2p: P2P, peer_id: str, maddrs: Sequence[str], timeout: float = CONNECT_TIMEOUT) -> bool:
    """Have p2pd connect to `peer_id` at `maddrs` unless already connected; False when every dial fails.

    Never raises for a bad address or an unreachable peer: the caller's next stream to the peer reports that."""
    try:
        addresses = [Multiaddr(to_daemon_bytes(m)) for m in maddrs]
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), addresses), timeout)
        return True
    except Exception as e:  # p2pd reports failed dials with assorted exception types
        logger.debug("dial %s at %s failed: %s", peer_id, list(maddrs), e)
        return False


async def create_swarm_node(
    initial_peers: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    client_mode: bool = False,
    announce_maddrs: Sequence[str] | None = None,
    identity_path: str | None = None,
    use_relay: bool = True,
    relay_service: bool = False,
    relays: Sequence[str] = (),
    swarm_key: SwarmKey | None = None,
) -> SwarmNode:
    """Start p2pd listening on host:port (0 = OS-assigned) and a DHT node joined to `initial_peers`.

    Raises ValueError for an unparsable multiaddr or conflicting options, and hivemind's error when no initial peer
    answers (in a private swarm: also when none accepts our key). See the module docstring for the options.
    """
    peers = _full_maddrs(initial_peers, "initial peer")
    relays = _full_maddrs(relays, "relay")
    if relay_service and relays:
        raise ValueError("a node cannot both be a relay (publicly reachable) and need relays (behind a NAT)")
    announce = [str(m).strip() for m in announce_maddrs or () if str(m).strip()]
    for maddr in announce:
        to_daemon_bytes(maddr)  # ValueError for a malformed one, before p2pd sees it
        if peer_id_of(maddr) is not None:
            raise ValueError(f"--announce-maddrs {maddr!r}: give the address without /p2p/<peer id>")
    if identity_path is not None:
        key = load_or_create_identity(identity_path)
        logger.info("identity %s: peer id %s", identity_path, key.peer_id)
    else:
        key = PeerKey.generate()  # the process holds its key either way: it signs records and pushes with it
    proto = "ip6" if ":" in host else "ip4"
    with ephemeral_identity(key) if identity_path is None else nullcontext(identity_path) as key_file:
        p2p = await P2P.create(
            initial_peers=peers or None,
            host_maddrs=[f"/{proto}/{host}/tcp/{port}"],
            announce_maddrs=announce or None,
            identity_path=key_file,
            # hivemind's check that nobody else uses the identity parses RSA keys only
            check_if_identity_free=identity_path is not None and not key.is_inline,
            nat_port_map=False,
            auto_nat=False,
            use_relay=use_relay or relay_service or bool(relays),
            use_auto_relay=bool(relays),
            trusted_relays=relays or None,
            force_reachability="public" if relay_service else "private" if relays else None,
            use_ipfs=False,
        )
    if p2p.peer_id.to_base58() != key.peer_id:
        await p2p.shutdown()
        raise RuntimeError(f"p2pd runs as {p2p.peer_id.to_base58()}, not as the identity's peer id {key.peer_id}")
    deepen_listen_backlog(p2p)  # before any handler: p2pd's stream bursts beyond 100 would be reset
    try:
        gate = None
        if swarm_key is not None:
            await serve_proofs(p2p, swarm_key)
            gate = MembershipGate(p2p, swarm_key)
        authorizer = SwarmKeyAuthorizer(swarm_key) if swarm_key is not None else None
        try:
            dht = await DHTNode.create(p2p=p2p, initial_peers=peers or None, client_mode=client_mode or bool(relays),
                                       # a reader's bootstrap search asks the same nodes sooner with a lookup's
                                       # requests in flight (joining 0.75-0.85 s instead of 1.0-1.4 s over 45-72 ms
                                       # round trips); a full node keeps hivemind's 4
                                       num_workers=LOOKUP_WORKERS if client_mode or relays else 4,
                                       authorizer=authorizer, record_validator=SignedRecordValidator(key),
                                       cache_size=CACHE_KEYS)
        except RuntimeError as e:
            if "bootstrap failed" not in str(e):
                raise
            raise RuntimeError(
                f"DHT bootstrap failed: none of the initial peers answered ({' '.join(peers)}): they are unreachable "
                "from here, or the swarm is private and "
                f"{'our swarm key differs' if swarm_key else 'we have no swarm key'}"
            ) from e
        verifier = install_record_storage(dht)
    except BaseException:
        await p2p.shutdown()
        raise
    node = SwarmNode(p2p=p2p, dht=dht, key=key, initial_peers=tuple(peers), relays=tuple(relays), gate=gate,
                     verifier=verifier)
    logger.debug(
        "dht node started peer_id=%s client_mode=%s private=%s relays=%d",
        node.peer_id,
        dht.protocol.client_mode,
        gate is not None,
        len(relays),
    )
    return node


def install_record_storage(dht: DHTNode, max_subkeys: int = MAX_SUBKEYS_PER_KEY,
                           answer_records: int = ANSWER_RECORDS) -> RecordVerifier:
    """Make `dht` keep and answer records by corolla's rules (dht.record_storage), keeping what peers stored meanwhile:
    its storage and cache replaced, its writers checked (dht.verifier, returned), and its store and find handlers
    wrapped so that the storage knows who sent a store and when it answers a lookup. `max_subkeys` and
    `answer_records` are the node's bounds per key (smaller in tests)."""
    protocol = dht.protocol
    verifier = RecordVerifier(lambda peer: ask_info(protocol.p2p, peer, CHECK_TIMEOUT), protocol.p2p.peer_id.to_base58())
    storage = RecordStorage(max_subkeys=max_subkeys, ranks=verifier, answer_records=answer_records)
    cache = RecordStorage(maxsize=CACHE_KEYS, max_subkeys=max_subkeys, cache=True)
    adopt(protocol.storage, storage)
    adopt(protocol.cache, cache)
    protocol.storage, protocol.cache = storage, cache
    if protocol.client_mode:
        return verifier  # a client-mode node serves no DHT RPCs: nobody stores at it or asks it
    handlers = protocol.p2p._client.control.unary_handlers  # hivemind 1.1: proto name -> (bytes, PeerID) -> bytes
    for method, bind in (("rpc_store", _with_sender), ("rpc_find", _answering)):
        name = DHTProtocol._get_handle_name(None, method)
        if name not in handlers:
            raise RuntimeError(f"hivemind's DHT registers no {name} handler: its record rules cannot be installed")
        handlers[name] = bind(handlers[name])
    return verifier


def _with_sender(handler):
    """A unary store handler run knowing which peer sent the request (record_storage.STORE_SENDER)."""

    async def store(request: bytes, remote_id: PeerID) -> bytes:
        token = STORE_SENDER.set(remote_id.to_base58())
        try:
            return await handler(request, remote_id)
        finally:
            STORE_SENDER.reset(token)

    return store


def _answering(handler):
    """A unary find handler run as an answer to a lookup (record_storage.ANSWERING)."""

    async def find(request: bytes, remote_id: PeerID) -> bytes:
        token = ANSWERING.set(True)
        try:
            return await handler(request, remote_id)
        finally:
            ANSWERING.reset(token)

    return find


def _full_maddrs(maddrs: Sequence[str], what: str) -> list[str]:
    out = [str(p).strip() for p in maddrs if str(p).strip()]
    for maddr in out:
        if peer_id_of(maddr) is None:
            raise ValueError(f"{what} {maddr!r} is not a full multiaddr (expected /ip4/HOST/tcp/PORT/p2p/PEERID)")
        to_daemon_bytes(maddr)
    return out
