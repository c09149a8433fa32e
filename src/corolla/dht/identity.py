"""A peer's identity on disk: a libp2p private key file, so that its peer id (and multiaddr) survive restarts.

The file holds one libp2p `PrivateKey` protobuf, as p2pd reads it with `-id`. New files hold an Ed25519 key (its
peer id contains its public key, so what the peer signs can be checked against its id alone); RSA files written by
older versions keep working. A missing file is created with mode 0600, atomically: a concurrent process creating
the same path gets the one key that won, never a half-written file.

A node started without an identity file gets a fresh key all the same (`ephemeral_identity`): the process must
hold its private key to sign its DHT records and its pushes (protocol.signing).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator

from corolla.protocol.signing import PeerKey

logger = logging.getLogger(__name__)


def load_or_create_identity(path: str) -> PeerKey:
    """The key in `path`, writing a new (Ed25519) key there first when the file does not exist.

    Raises FileNotFoundError when the directory does not exist and ValueError when the file is not a private key.
    A key file that other users can read is used, with a warning.
    """
    path = os.path.abspath(os.path.expanduser(path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the directory {directory} for the identity file does not exist")
    if not os.path.exists(path):
        _create(path, PeerKey.generate())
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        logger.warning("identity file %s is readable by other users (mode %o): chmod 600 it", path, mode)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return PeerKey.from_identity(data)
    except ValueError as e:
        raise ValueError(f"{path} is not a libp2p private key file: {e}") from e


@contextmanager
def ephemeral_identity(key: PeerKey) -> Iterator[str]:
    """A private (0600, in a 0700 directory) identity file holding `key` while the block runs, for p2pd to read at
    start-up; removed afterwards."""
    directory = tempfile.mkdtemp(prefix="corolla-id-")
    path = os.path.join(directory, "identity.key")
    try:
        _create(path, key)
        yield path
    finally:
        for leftover in (path, directory):
            try:
                (os.unlink if leftover == path else os.rmdir)(leftover)
            except OSError:
                pass


def _create(path: str, key: PeerKey) -> None:
    fd, temporary = tempfile.mkstemp(prefix=".identity-", dir=os.path.dirname(path))  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.to_identity())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temporary, path)  # fails if another process created the file meanwhile: theirs wins
            logger.info("created a new identity in %s", path)
        except FileExistsError:
            pass
    finally:
        os.unlink(temporary)
