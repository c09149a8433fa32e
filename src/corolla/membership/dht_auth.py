"""Every DHT RPC of a private swarm carries a MAC under the swarm key; hivemind drops the ones that do not check.

hivemind's DHT protocol wraps each RPC with an authorizer (`DHTNode.create(authorizer=...)`): the caller signs
the request, the callee validates it (an invalid request gets no answer), the callee signs its response and the
caller validates that (an invalid response counts as no answer). hivemind's own TokenAuthorizerBase does this with
RSA signatures and access tokens from a central server; here a shared key is enough:

    request.auth.time  = sender's DHT time         request.auth.nonce = 16 random bytes
    request.auth.signature  = HMAC(K_request,  request serialized with an empty signature)
    response.auth.nonce     = request.auth.nonce
    response.auth.signature = HMAC(K_response, response serialized with an empty signature)

A request is accepted once: its nonce is remembered for a while, and a request older (or newer) than
MAX_CLOCK_SKEW seconds is refused, so a recorded request cannot be replayed later. A response is bound to its
request by the nonce. Strangers can therefore neither read nor write the DHT of a private swarm, nor feed its
members false answers: without the key they can produce no MAC that checks.
"""

from __future__ import annotations

import logging
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from corolla.membership.key import SwarmKey

logger = logging.getLogger(__name__)

REQUEST_LABEL = "corolla/dht-request/v1"
RESPONSE_LABEL = "corolla/dht-response/v1"
MAX_CLOCK_SKEW = 60.0  # seconds a request's timestamp may differ from the receiver's clock
NONCE_BYTES = 16


class SwarmKeyAuthorizer(AuthorizerBase):
    """hivemind AuthorizerBase that signs and checks DHT RPCs with the swarm key (see the module docstring)."""

    def __init__(self, key: SwarmKey):
        self.key = key
        self._seen_nonces: TimedStorage[bytes, None] = TimedStorage()
        self.rejected = 0  # requests and responses refused so far (for logs and tests)

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: RSAPublicKey | None) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = self.key.mac(REQUEST_LABEL, request.SerializeToString(deterministic=True))

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        valid = self.key.check(REQUEST_LABEL, signature, request.SerializeToString(deterministic=True))
        auth.signature = signature
        now = get_dht_time()
        if not valid:
            return self._reject("DHT request with a bad MAC (a peer without this swarm's key?)")
        if abs(auth.time - now) > MAX_CLOCK_SKEW:
            return self._reject(
                f"DHT request stamped {auth.time - now:+.0f}s from our clock (replayed, or clocks apart)"
            )
        with self._seen_nonces.freeze():
            if auth.nonce in self._seen_nonces:
                return self._reject("DHT request replayed")
        self._seen_nonces.store(auth.nonce, None, now + 3 * MAX_CLOCK_SKEW)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self.key.mac(RESPONSE_LABEL, response.SerializeToString(deterministic=True))

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        valid = self.key.check(RESPONSE_LABEL, signature, response.SerializeToString(deterministic=True))
        auth.signature = signature
        if not valid:
            return self._reject("DHT response with a bad MAC")
        if auth.nonce != request.auth.nonce:
            return self._reject("DHT response to another request")
        return True

    def _reject(self, reason: str) -> bool:
        self.rejected += 1
        logger.debug("dht auth refused: %s", reason)
        return False
