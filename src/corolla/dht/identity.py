"""A peer's identity on disk: a libp2p private key file, so that its peer id (and multiaddr) survive restarts.

The file holds one libp2p `PrivateKey` protobuf (an RSA key, as hivemind and p2pd read it with `-id`). A missing
file is created with mode 0600, atomically: a concurrent process creating the same path gets the one key that
won, never a half-written file.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

logger = logging.getLogger(__name__)


def load_or_create_identity(path: str) -> str:
    """The base58 peer id of the key in `path`, writing a new key there first when the file does not exist.

    Raises FileNotFoundError when the directory does not exist and ValueError when the file is not a private key.
    A key file that other users can read is used, with a warning.
    """
    path = os.path.abspath(os.path.expanduser(path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the directory {directory} for the identity file does not exist")
    if not os.path.exists(path):
        _create(path)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        logger.warning("identity file %s is readable by other users (mode %o): chmod 600 it", path, mode)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as e:  # protobuf and DER parsers raise assorted types
        raise ValueError(f"{path} is not a libp2p private key file: {e}") from e


def _create(path: str) -> None:
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    fd, temporary = tempfile.mkstemp(prefix=".identity-", dir=os.path.dirname(path))  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temporary, path)  # fails if another process created the file meanwhile: theirs wins
            logger.info("created a new identity in %s", path)
        except FileExistsError:
            pass
    finally:
        os.unlink(temporary)
