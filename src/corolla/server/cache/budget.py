"""Pure KV-cache accounting: a token budget shared by all sessions of a server, and what each peer holds of it.

A session of batch B and max_length L costs B * L tokens (each token's keys and values in every hosted block).
`try_reserve` returns False rather than raising when the budget cannot hold a request: the caller decides
whether to wait or to refuse.
"""

from __future__ import annotations

from collections import Counter


class CacheBudget:
    def __init__(self, total_tokens: int):
        if total_tokens < 0:
            raise ValueError("total_tokens must be >= 0")
        self.total = total_tokens
        self._held: dict[str, tuple[str, int]] = {}  # owner -> (its peer, tokens)
        self._by_peer: Counter[str] = Counter()  # peer -> tokens its owners hold

    @property
    def used(self) -> int:
        return sum(tokens for _, tokens in self._held.values())

    @property
    def free(self) -> int:
        return self.total - self.used

    def held_by(self, peer: str) -> int:
        """Tokens the reservations of `peer` hold."""
        return self._by_peer.get(peer, 0)

    def holdings(self) -> dict[str, int]:
        """Tokens held per peer (peers holding some only), a copy."""
        return dict(self._by_peer)

    def try_reserve(self, owner: str, tokens: int, peer: str = "") -> bool:
        """Reserve `tokens` for `owner` (on behalf of `peer`) if they fit; an owner holds at most one reservation."""
        if tokens <= 0:
            raise ValueError("a reservation needs at least one token")
        if owner in self._held:
            raise ValueError(f"{owner} already holds a reservation")
        if tokens > self.free:
            return False
        self._held[owner] = (peer, tokens)
        self._by_peer[peer] += tokens
        return True

    def release(self, owner: str) -> int:
        """Free what `owner` holds; returns the tokens freed (0 if it held nothing)."""
        peer, tokens = self._held.pop(owner, ("", 0))
        if tokens:
            self._by_peer[peer] -= tokens
            if not self._by_peer[peer]:
                del self._by_peer[peer]
        return tokens
