"""Per-peer record of spot checks (client.trust.spot_checks): checks passed and failed, and peers distrusted for lying.

Why a file: a client's view of who lied matters after the process ends (the next run should not route through a
server that was caught), and `corolla status` runs in another process. Each client merges its counts into one
small JSON file under the user's cache dir (`$COROLLA_CACHE/reputation.json`, default ~/.cache/corolla), written
atomically after every check that changed something. The file is a record, not a ban list: a client bans the
liars *it* caught, for its own lifetime; a later client starts clean (a false alarm, or a server whose operator
fixed a bad GPU, is not punished forever). Nothing is shared with other machines (sharing proven mismatches
through the DHT is future work).

    {"peers": {"12D3Koo...": {"passed": 12, "failed": 1, "distrusted": true, "last": 1764052000.0}}}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class PeerRecord:
    passed: int = 0  # spot checks this peer's outputs passed (as the checked server or as the one that agreed)
    failed: int = 0  # spot checks that found this peer wrong
    distrusted: bool = False  # banned for returning wrong outputs: never routed through again
    last: float = 0.0  # unix time of the last check that involved it


def default_path() -> Path:
    """`$COROLLA_CACHE/reputation.json`, else ~/.cache/corolla/reputation.json."""
    root = os.environ.get("COROLLA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "corolla")
    return Path(root) / "reputation.json"


def load(path: Path | None = None) -> dict[str, PeerRecord]:
    """The records in `path` (default_path()); an absent or unreadable file is an empty record."""
    path = path or default_path()
    try:
        raw = json.loads(path.read_text())
        return {peer: PeerRecord(**{k: v for k, v in rec.items() if k in PeerRecord.__dataclass_fields__})
                for peer, rec in raw.get("peers", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


class Reputation:
    """One client's records, by peer id; `persist=True` merges them into the JSON file after each change."""

    def __init__(self, path: Path | None = None, persist: bool = True):
        self.path = path or default_path()
        self.persist = persist
        self.records: dict[str, PeerRecord] = {}  # this client's own checks only
        self._saved: dict[str, PeerRecord] = {}  # what this client has already merged into the file

    def get(self, peer_id: str) -> PeerRecord:
        return self.records.setdefault(peer_id, PeerRecord())

    def checked(self, peer_id: str) -> bool:
        rec = self.records.get(peer_id)
        return rec is not None and rec.passed + rec.failed > 0

    def distrusted(self) -> set[str]:
        return {peer for peer, rec in self.records.items() if rec.distrusted}

    def passed(self, peer_id: str) -> None:
        rec = self.get(peer_id)
        rec.passed += 1
        rec.last = time.time()

    def failed(self, peer_id: str, distrust: bool) -> None:
        rec = self.get(peer_id)
        rec.failed += 1
        rec.distrusted = rec.distrusted or distrust
        rec.last = time.time()

    def snapshot(self) -> dict[str, dict[str, object]]:
        """{peer id: {"passed", "failed", "distrusted", "last"}}: a copy, for the Python API."""
        return {peer: asdict(rec) for peer, rec in self.records.items()}

    def save(self) -> None:
        """Merge this client's changes since the last save into the file (other clients' counts are kept)."""
        if not self.persist:
            return
        try:
            merged = load(self.path)
            for peer, rec in self.records.items():
                old = self._saved.get(peer, PeerRecord())
                into = merged.setdefault(peer, PeerRecord())
                into.passed += rec.passed - old.passed
                into.failed += rec.failed - old.failed
                into.distrusted = into.distrusted or rec.distrusted
                into.last = max(into.last, rec.last)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".reputation.")
            with os.fdopen(fd, "w") as f:
                json.dump({"peers": {peer: asdict(rec) for peer, rec in merged.items()}}, f, indent=1)
            os.replace(tmp, self.path)
            self._saved = {peer: PeerRecord(**asdict(rec)) for peer, rec in self.records.items()}
        except OSError as e:
            logger.debug("could not save reputation to %s: %s", self.path, e)
