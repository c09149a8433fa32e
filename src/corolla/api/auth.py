"""API keys (`corolla api --api-keys FILE`): which key, if any, an `Authorization: Bearer KEY` header carries.

The file holds one key per line; blank lines and lines starting with `#` are ignored, surrounding whitespace is
stripped. A key is checked in time independent of where it differs from the real keys and of which key it
matches: the SHA-256 of the offered key is compared with every key's (hmac.compare_digest), every time. A valid
key is known afterwards only by its id (a prefix of its SHA-256), so logs and the engine's bookkeeping never hold
the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Sequence


def key_id(key: str) -> str:
    """The name a key goes by inside the API: `key-` and 12 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    """The keys a request may present; `owner(header)` -> the key's id, or None."""

    def __init__(self, keys: Sequence[str]):
        if not keys:
            raise ValueError("no API keys given")
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in dict.fromkeys(keys)]

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """Read the keys file. Raises ValueError naming the file when it cannot be read, holds no key, or a line
        holds more than one word (a key never contains whitespace: it travels in a header)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-keys: cannot read {path}: {e}") from e
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if len(line.split()) != 1:
                raise ValueError(f"--api-keys: {path} line {number}: a key cannot contain whitespace")
            keys.append(line)
        if not keys:
            raise ValueError(f"--api-keys: {path} holds no key (one per line; blank lines and # comments are ignored)")
        return cls(keys)

    def owner(self, authorization: str | None) -> str | None:
        """The id of the key in an `Authorization: Bearer KEY` header value, or None (no header, another scheme,
        or not one of the keys)."""
        offered = _bearer(authorization)
        digest = hashlib.sha256(offered.encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, name in self._digests:  # no early exit: every key is compared
            if hmac.compare_digest(digest, known) and offered:
                found = name
        return found


def _bearer(authorization: str | None) -> str:
    """The token of a `Bearer TOKEN` header value ("" when absent or of another scheme)."""
    if not authorization:
        return ""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
