"""Where a checkpoint's files come from: a local directory or a Hugging Face hub repo.

All hub traffic goes through :class:`HubClient` (two methods), so tests substitute a fake that
copies from a local directory. Files fetched from the hub land in the cache directory
(``$COROLLA_CACHE``, else ``~/.cache/corolla``) in the hub's usual cache layout, and are recorded
in corolla's disk-cache ledger, which enforces ``max_disk_space`` by LRU eviction.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoConfig, PretrainedConfig

from corolla.checkpoint.disk_cache import DiskCache

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$COROLLA_CACHE`` when set and non-empty, else ``~/.cache/corolla`` (read at call time)."""
    env = os.environ.get("COROLLA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "corolla"


class HubFiles(Protocol):
    """The two hub operations corolla needs; :class:`HubClient` is the real one."""

    def list_files(
        self, repo_id: str, *, revision: str | None, token: str | None, cache_dir: Path
    ) -> dict[str, int | None]: ...

    def download(
        self, repo_id: str, filename: str, *, revision: str | None, token: str | None, cache_dir: Path
    ) -> Path: ...


class HubClient:
    """The real hub: ``HfApi().model_info(files_metadata=True)`` and ``hf_hub_download``."""

    def list_files(
        self, repo_id: str, *, revision: str | None, token: str | None, cache_dir: Path
    ) -> dict[str, int | None]:
        """Every file of the repo at `revision` -> its size in bytes (None when the hub omits it).

        Offline (or when the hub fails) falls back to the files of a locally cached snapshot,
        so a machine that already holds its weights restarts without the network.

        Raises:
            OSError: the hub failed and nothing of this repo is cached (the hub's own error when it
                is an OSError, such as RepositoryNotFoundError; else a ConnectionError).
        """
        try:
            info = HfApi().model_info(repo_id, revision=revision, token=token, files_metadata=True)
        # Network failures arrive as OSError or httpx-family errors whose module differs between
        # hub versions; any failure falls back to the local snapshot, else re-raises as is.
        except Exception as e:
            snapshot = _cached_snapshot(repo_id, revision=revision, cache_dir=cache_dir)
            if snapshot is None:
                if isinstance(e, OSError):
                    raise
                raise ConnectionError(f"hub request for {repo_id!r} failed: {e!r}") from e
            logger.warning("hub.list_failed repo=%s error=%r; using cached snapshot %s", repo_id, e, snapshot)
            return {
                p.relative_to(snapshot).as_posix(): p.stat().st_size
                for p in sorted(snapshot.rglob("*"))
                if p.is_file()
            }
        return {s.rfilename: s.size for s in info.siblings or []}

    def download(
        self, repo_id: str, filename: str, *, revision: str | None, token: str | None, cache_dir: Path
    ) -> Path:
        """Downloads `filename` into `cache_dir` (or reuses the cached copy); returns its local path."""
        return Path(
            hf_hub_download(repo_id, filename, cache_dir=cache_dir, revision=revision, token=token)
        )


def _cached_snapshot(repo_id: str, *, revision: str | None, cache_dir: Path) -> Path | None:
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except (OSError, ValueError):  # LocalEntryNotFoundError is an OSError
        return None


class CheckpointSource:
    """A checkpoint in a local directory, or in a hub repo fetched file by file into a cache.

    `model` is a local directory when one exists at that path (it wins over a repo of the same
    name), else a hub repo id. Nothing is read or downloaded until asked for. For a hub repo,
    `max_disk_space` (bytes, None = unlimited) caps the files corolla keeps in `cache_dir`.

    Raises (from the constructor):
        FileNotFoundError: `model` is neither an existing directory nor a valid hub repo id.
    """

    def __init__(
        self,
        model: str,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        revision: str | None = None,
        token: str | None = None,
        max_disk_space: int | None = None,
        hub: HubFiles | None = None,
    ) -> None:
        self.model = str(model)
        local = Path(self.model).expanduser()
        self.local_dir: Path | None = local if local.is_dir() else None
        if self.local_dir is None:
            try:
                validate_repo_id(self.model)
            except HFValidationError as e:
                raise FileNotFoundError(
                    f"{self.model!r} is neither an existing directory nor a valid hub repo id"
                ) from e
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.revision = revision
        self.token = token
        self.max_disk_space = max_disk_space
        self.hub: HubFiles = hub if hub is not None else HubClient()
        self._files: dict[str, int | None] | None = None

    @property
    def is_local(self) -> bool:
        return self.local_dir is not None

    def __repr__(self) -> str:
        if self.local_dir is not None:
            return f"CheckpointSource(local_dir={str(self.local_dir)!r})"
        return f"CheckpointSource(repo={self.model!r}, revision={self.revision or 'main'!r})"

    def files(self) -> dict[str, int | None]:
        """Every file of the checkpoint (relative posix path) -> size in bytes, None when unknown.

        Listed once per source object. Raises FileNotFoundError when a hub repo cannot be listed.
        """
        if self._files is None:
            if self.local_dir is not None:
                root = self.local_dir
                self._files = {
                    p.relative_to(root).as_posix(): p.stat().st_size
                    for p in sorted(root.rglob("*"))
                    if p.is_file() and ".cache" not in p.relative_to(root).parts
                }
            else:
                try:
                    self._files = self.hub.list_files(
                        self.model, revision=self.revision, token=self.token, cache_dir=self.cache_dir
                    )
                except OSError as e:
                    raise FileNotFoundError(
                        f"{self.model!r} is not a local directory, and listing it on the hub failed: {e}"
                    ) from e
        return self._files

    def cache_key(self, filename: str) -> str:
        """The disk-cache ledger key of `filename` in this repo."""
        return f"{self.model}@{self.revision or 'main'}:{filename}"

    def make_room(self, filenames: Collection[str], *, keep: Collection[str] = ()) -> None:
        """Evicts cached files until all of `filenames` not yet cached fit under `max_disk_space`.

        Files in `filenames` or `keep` are never evicted. A no-op for a local directory or without
        a limit. A file the hub lists without a size counts as 0 bytes. Raises DiskSpaceError when
        the limit cannot be met (then nothing is deleted).
        """
        if self.local_dir is not None or self.max_disk_space is None:
            return
        cache = DiskCache(self.cache_dir)
        sizes = self.files()
        needed = sum(
            sizes.get(name) or 0 for name in set(filenames) if cache.cached_path(self.cache_key(name)) is None
        )
        if needed == 0:  # everything is cached: nothing to download, nothing to evict
            return
        protected = {self.cache_key(name) for name in (*filenames, *keep)}
        cache.make_room(needed, self.max_disk_space, protected)

    def fetch(self, filename: str, *, keep: Collection[str] = ()) -> Path:
        """A local path to `filename`, downloading it into the cache first for a hub repo.

        Before a download, makes room under `max_disk_space` without evicting `filename` or
        anything in `keep`. Each fetch marks the file as most recently used.

        Raises:
            FileNotFoundError: the checkpoint has no such file.
            DiskSpaceError: the file cannot fit under `max_disk_space`.
        """
        if self.local_dir is not None:
            path = self.local_dir / filename
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist")
            return path
        if filename not in self.files():
            raise FileNotFoundError(
                f"hub repo {self.model!r} (revision {self.revision or 'main'}) has no file {filename!r}"
            )
        self.make_room([filename], keep=keep)
        logger.debug("checkpoint.fetch repo=%s file=%s", self.model, filename)
        path = self.hub.download(
            self.model, filename, revision=self.revision, token=self.token, cache_dir=self.cache_dir
        )
        DiskCache(self.cache_dir).record_use(self.cache_key(filename), path)
        return path


def load_config(
    model: str,
    *,
    cache_dir: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    hub: HubFiles | None = None,
) -> PretrainedConfig:
    """The model's ``AutoConfig``, from a local directory or a hub repo id (a local directory wins).

    `hub` substitutes the hub client (tests); leave it None.

    Raises:
        FileNotFoundError: `model` is neither a directory nor a valid repo id, the repo cannot be
            reached, or there is no config.json.
        ValueError: transformers does not recognize the config.
    """
    source = CheckpointSource(model, cache_dir=cache_dir, revision=revision, token=token, hub=hub)
    config_path = source.fetch("config.json")
    # The directory holding config.json: the local dir, or the hub cache's snapshot folder.
    return AutoConfig.from_pretrained(config_path.parent)
