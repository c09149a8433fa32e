"""Pure KV-cache accounting: a token budget shared by all sessions of a server.

A session of batch B and max_length L costs B * L tokens (each token's keys and values in every hosted block).
`try_reserve` returns False rather than raising when the budget cannot hold a request: the caller decides
whether to wait or to refuse.
"""

from __future__ import annotations


class CacheBudget:
    def __init__(self, total_tokens: int):
        if total_tokens < 0:
            raise ValueError("total_tokens must be >= 0")
        self.total = total_tokens
        self._held: dict[str, int] = {}

    @property
    def used(self) -> int:
        return sum(self._held.values())

    @property
    def free(self) -> int:
        return self.total - self.used

    def try_reserve(self, owner: str, tokens: int) -> bool:
        """Reserve `tokens` for `owner` if they fit; an owner holds at most one reservation."""
        if tokens <= 0:
            raise ValueError("a reservation needs at least one token")
        if owner in self._held:
            raise ValueError(f"{owner} already holds a reservation")
        if tokens > self.free:
            return False
        self._held[owner] = tokens
        return True

    def release(self, owner: str) -> int:
        """Free what `owner` holds; returns the tokens freed (0 if it held nothing)."""
        return self._held.pop(owner, 0)
