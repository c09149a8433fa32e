"""Membership of a private swarm, proven per peer by a challenge over the peer's own authenticated connection.

Every p2pd connection is encrypted and authenticated (Noise or TLS): a stream handler knows for certain which peer
id opened the stream, but not whether that peer holds the swarm key. So before a server reads anything from a
stream, `MembershipGate.authorize(peer_id)` asks the peer to prove it:

    server S                                         peer P (every member answers on MEMBER_PROTOCOL)
      open stream MEMBER_PROTOCOL to P   ------>
      nonce (16 random bytes)            ------>
                                         <------     HMAC(K_member, nonce, P's peer id, S's peer id)
      check with P and S as S sees them (the stream's authenticated ends)

The proof names both ends and a fresh nonce, so it convinces only S, only now, only about P: a stranger who gets
a member to answer its own challenge learns a MAC it can show to nobody else. A proof is remembered for
`proven_ttl` seconds, so a peer pays the round trip once, not per stream; a failed proof is remembered for
`refused_ttl` seconds, so a stranger opening many streams cannot make the server open as many challenges.
The challenge rides on the connection P already opened (libp2p opens streams both ways over one connection), so
it works when P is behind a NAT or reached the server through a relay.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from contextlib import closing

from hivemind.p2p import P2P, PeerID

from corolla.membership.key import MAC_BYTES, SwarmKey

logger = logging.getLogger(__name__)

MEMBER_PROTOCOL = "corolla/member/v1"
PROOF_LABEL = "corolla/member-proof/v1"
NONCE_BYTES = 16


def proof_for(key: SwarmKey, nonce: bytes, prover: str, verifier: str) -> bytes:
    """The MAC that `prover` (a peer id) returns for `nonce` when `verifier` challenges it."""
    return key.mac(PROOF_LABEL, nonce, prover.encode(), verifier.encode())


async def serve_proofs(p2p: P2P, key: SwarmKey, timeout: float = 10.0) -> None:
    """Answer other members' challenges on this node (every member of a private swarm runs this)."""
    me = p2p.peer_id.to_base58()

    async def on_challenge(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with closing(writer):
            try:
                nonce = await asyncio.wait_for(reader.readexactly(NONCE_BYTES), timeout)
                writer.write(proof_for(key, nonce, me, stream_info.peer_id.to_base58()))
                await writer.drain()
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                logger.debug("membership challenge from %s broke: %r", stream_info.peer_id, e)

    await p2p.add_binary_stream_handler(MEMBER_PROTOCOL, on_challenge)


class MembershipGate:
    """`await gate.authorize(peer_id)`: True once the peer has proven it holds the swarm key (see module doc)."""

    def __init__(self, p2p: P2P, key: SwarmKey, *, proven_ttl: float = 3600.0, refused_ttl: float = 10.0,
                 timeout: float = 10.0, max_peers: int = 100_000):
        self.p2p = p2p
        self.key = key
        self.proven_ttl = proven_ttl  # seconds a successful proof is trusted
        self.refused_ttl = refused_ttl  # seconds a failed proof is remembered
        self.timeout = timeout  # seconds a challenge may take
        self.max_peers = max_peers  # remembered verdicts, oldest forgotten first
        self._verdicts: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # peer -> (until, member?)
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self.challenges = 0  # challenges sent so far (for logs and tests)

    async def authorize(self, peer_id: str) -> bool:
        """Whether `peer_id` (the authenticated remote end of a stream) is a member; challenges it when unknown.

        Never raises: an unreachable or silent peer, or a wrong proof, is not a member (for `refused_ttl`)."""
        if peer_id == self.p2p.peer_id.to_base58():
            return True
        verdict = self._verdicts.get(peer_id)
        if verdict is not None and verdict[0] > time.monotonic():
            return verdict[1]
        pending = self._pending.get(peer_id)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._pending[peer_id] = pending
            member = False
            try:
                member = await self._challenge(peer_id)
                self._remember(peer_id, member)
            finally:  # waiters get a verdict even when this caller is cancelled mid-challenge
                del self._pending[peer_id]
                pending.set_result(member)
            return member
        return await asyncio.shield(pending)

    async def _challenge(self, peer_id: str) -> bool:
        self.challenges += 1
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), MEMBER_PROTOCOL), self.timeout)
            with closing(writer):
                writer.write(nonce)
                await writer.drain()
                proof = await asyncio.wait_for(reader.readexactly(MAC_BYTES), self.timeout)
        except Exception as e:  # p2pd reports a peer without the handler, or gone, with assorted exceptions
            logger.info("peer %s did not answer the membership challenge (%s): refused", peer_id, type(e).__name__)
            return False
        if not self.key.check(PROOF_LABEL, proof, nonce, peer_id.encode(), self.p2p.peer_id.to_base58().encode()):
            logger.info("peer %s failed the membership challenge (another swarm key): refused", peer_id)
            return False
        logger.debug("peer %s proved membership", peer_id)
        return True

    def _remember(self, peer_id: str, member: bool) -> None:
        self._verdicts[peer_id] = (time.monotonic() + (self.proven_ttl if member else self.refused_ttl), member)
        self._verdicts.move_to_end(peer_id)
        while len(self._verdicts) > self.max_peers:
            self._verdicts.popitem(last=False)
