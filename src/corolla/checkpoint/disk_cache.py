"""A size-limited cache of downloaded checkpoint files with least-recently-used eviction.

The cache keeps a small JSON ledger (``corolla-disk-cache.json`` in the cache directory) with one
entry per file that corolla fetched there: its key (``"{repo_id}@{revision}:{filename}"``), its
local path, its size and when it was last used. Only files in the ledger are counted against the
limit or ever deleted: other things that share the directory (a user's own Hugging Face downloads)
are left alone.

The eviction decision is the pure function :func:`choose_evictions`; :class:`DiskCache` does the
I/O around it (ledger, lock, deleting files).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LEDGER_NAME = "corolla-disk-cache.json"
LOCK_NAME = "corolla-disk-cache.lock"
_LEDGER_VERSION = 1


class DiskSpaceError(RuntimeError):
    """The files one load needs do not fit under the disk-space limit, whatever is evicted."""


@dataclass(frozen=True)
class CacheEntry:
    """One cached file, as the ledger records it."""

    key: str  # "{repo_id}@{revision}:{filename}"
    size: int  # bytes on disk
    last_access: float  # seconds since the epoch; strictly increasing across uses of one ledger
    path: str = ""  # local path (for a hub cache: the snapshot symlink); empty in unit tests


def choose_evictions(
    entries: Sequence[CacheEntry], needed_bytes: int, limit_bytes: int, protected: set[str]
) -> list[str]:
    """Which cached files to delete so that `needed_bytes` more fit under `limit_bytes`.

    Picks unprotected entries least recently used first (ties broken by key), stopping as soon
    as ``sum(sizes) - evicted + needed_bytes <= limit_bytes``. Returns their keys in eviction
    order; an empty list when everything already fits. Never picks a key in `protected`.

    Raises:
        DiskSpaceError: even evicting every unprotected entry would not make room.
    """
    total = sum(entry.size for entry in entries)
    excess = total + needed_bytes - limit_bytes  # bytes to free
    if excess <= 0:
        return []
    candidates = sorted(
        (entry for entry in entries if entry.key not in protected),
        key=lambda entry: (entry.last_access, entry.key),
    )
    victims: list[str] = []
    for entry in candidates:
        victims.append(entry.key)
        excess -= entry.size
        if excess <= 0:
            return victims
    protected_bytes = sum(entry.size for entry in entries if entry.key in protected)
    raise DiskSpaceError(
        f"max_disk_space={limit_bytes} bytes cannot hold this load: it needs {needed_bytes} bytes "
        f"more while {protected_bytes} bytes of files it also needs are already cached"
    )


class DiskCache:
    """The ledger of files corolla downloaded into one cache directory.

    Safe to share between processes on one machine: every read-modify-write of the ledger holds
    an exclusive ``flock`` on ``corolla-disk-cache.lock`` (where ``fcntl`` exists), and the ledger is
    replaced atomically. Downloads happen outside the lock, so two processes filling the same cache
    at once can briefly overshoot the limit; the next eviction corrects it.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)
        self._ledger_path = self.cache_dir / LEDGER_NAME

    def entries(self) -> list[CacheEntry]:
        """The ledger's entries whose files still exist."""
        return [entry for entry in self._read().values() if os.path.exists(entry.path)]

    def cached_path(self, key: str) -> Path | None:
        """The local path of `key` when the ledger has it and the file still exists, else None."""
        entry = self._read().get(key)
        if entry is None or not os.path.exists(entry.path):
            return None
        return Path(entry.path)

    def make_room(self, needed_bytes: int, limit_bytes: int, protected: set[str]) -> list[str]:
        """Deletes least recently used files until `needed_bytes` more fit under `limit_bytes`.

        Files whose keys are in `protected` are never deleted. Returns the evicted keys.

        Raises:
            DiskSpaceError: the limit cannot be met (nothing is deleted then).
        """
        with self._locked():
            ledger = {key: e for key, e in self._read().items() if os.path.exists(e.path)}
            victims = choose_evictions(list(ledger.values()), needed_bytes, limit_bytes, protected)
            for key in victims:
                entry = ledger.pop(key)
                _delete_cached_file(Path(entry.path))
                logger.info("disk_cache.evict key=%s size=%d", key, entry.size)
            self._write(ledger)
        return victims

    def record_use(self, key: str, path: Path) -> None:
        """Marks `key` (stored at `path`) as used now, adding it to the ledger when new."""
        with self._locked():
            ledger = self._read()
            latest = max((entry.last_access for entry in ledger.values()), default=0.0)
            now = max(time.time(), latest + 1e-6)  # strictly increasing: LRU order never ties
            ledger[key] = CacheEntry(key, os.path.getsize(path), now, str(path))
            self._write(ledger)

    def _read(self) -> dict[str, CacheEntry]:
        try:
            raw = json.loads(self._ledger_path.read_text())
            return {
                key: CacheEntry(key, int(e["size"]), float(e["last_access"]), str(e["path"]))
                for key, e in raw["entries"].items()
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # A damaged ledger only loses LRU history; the files stay and are re-recorded on use.
            logger.warning("disk_cache.ledger_unreadable path=%s error=%r", self._ledger_path, e)
            return {}

    def _write(self, ledger: dict[str, CacheEntry]) -> None:
        payload = {
            "version": _LEDGER_VERSION,
            "entries": {
                key: {"size": e.size, "last_access": e.last_access, "path": e.path}
                for key, e in sorted(ledger.items())
            },
        }
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".ledger-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1)
            os.replace(tmp, self._ledger_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # Windows: no cross-process lock; single-process use stays correct
            yield
            return
        with open(self.cache_dir / LOCK_NAME, "a+") as lock_file:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _delete_cached_file(path: Path) -> None:
    """Deletes `path`; when it is a hub-cache snapshot symlink, deletes the blob it points to too."""
    blob = path.resolve() if path.is_symlink() else None
    path.unlink(missing_ok=True)
    if blob is not None:
        blob.unlink(missing_ok=True)
