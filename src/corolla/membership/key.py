"""The swarm key: one shared secret whose holders are the members of a private swarm.

File format (the one IPFS/libp2p use for private networks, so the same file would serve a transport-level
pre-shared key if the bundled p2pd ever supports one):

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits: 32 random bytes>

The secret is never used directly: each use gets its own subkey, HMAC-SHA256(secret, label), so a MAC computed
for one purpose (a DHT request, a DHT response, a membership proof) can never be replayed as another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

HEADER = "/key/swarm/psk/1.0.0/"
ENCODING = "/base16/"
KEY_BYTES = 32
MAC_BYTES = 32


@dataclass(frozen=True)
class SwarmKey:
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ValueError(f"a swarm key is {KEY_BYTES} bytes, got {len(self.secret)}")

    @property
    def fingerprint(self) -> str:
        """A short public name of the key (for logs; reveals nothing useful about the secret)."""
        return hashlib.sha256(b"corolla swarm key fingerprint" + self.secret).hexdigest()[:12]

    def subkey(self, label: str) -> bytes:
        return hmac.new(self.secret, label.encode(), hashlib.sha256).digest()

    def mac(self, label: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 under the subkey for `label` over `parts`, each length-prefixed (so part boundaries count)."""
        h = hmac.new(self.subkey(label), digestmod=hashlib.sha256)
        for part in parts:
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
        return h.digest()

    def check(self, label: str, mac: bytes, *parts: bytes) -> bool:
        """Whether `mac` is mac(label, *parts), compared in constant time."""
        return hmac.compare_digest(self.mac(label, *parts), mac)


def generate_swarm_key(path: str) -> SwarmKey:
    """Write a new random key to `path` (mode 0600); FileExistsError if the file exists (never overwrites)."""
    key = SwarmKey(secrets.token_bytes(KEY_BYTES))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{HEADER}\n{ENCODING}\n{key.secret.hex()}\n")
    return key


def load_swarm_key(path: str) -> SwarmKey:
    """Read a swarm key file; ValueError (naming the file) when it is not one, FileNotFoundError when missing."""
    with open(path) as f:
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    if len(lines) != 3 or lines[0] != HEADER or lines[1] != ENCODING:
        raise ValueError(f"{path} is not a swarm key file (expected {HEADER!r}, {ENCODING!r} and 64 hex digits; "
                         f"make one with `corolla swarm-key PATH`)")
    try:
        secret = bytes.fromhex(lines[2])
    except ValueError:
        raise ValueError(f"{path}: the key is not hexadecimal") from None
    if len(secret) != KEY_BYTES:
        raise ValueError(f"{path}: the key must be {KEY_BYTES * 2} hex digits, got {len(lines[2])}")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        logger.warning("swarm key %s is readable by other users (mode %o): chmod 600 it", path, mode)
    return SwarmKey(secret)
