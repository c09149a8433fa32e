"""Reading only the wanted tensors of a Hugging Face checkpoint, touching only the files that hold them.

Supported layouts, in order of preference (safetensors wins when both formats exist)::

    model.safetensors.index.json  + shards   -> only the shards holding wanted tensors are fetched
    model.safetensors                         -> the one file; only wanted keys are read
    pytorch_model.bin.index.json  + shards   -> as for safetensors shards
    pytorch_model.bin                         -> the one file, memory-mapped; wanted tensors copied out
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from corolla.checkpoint.source import CheckpointSource, HubFiles

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
_LAYOUTS: tuple[tuple[str, str, Literal["safetensors", "bin"]], ...] = (
    (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"),
    (BIN_INDEX, BIN_SINGLE, "bin"),
)

Wanted = Callable[[str], bool]


@dataclass(frozen=True)
class _Layout:
    format: Literal["safetensors", "bin"]
    index_file: str | None  # the index json, None for a single-file checkpoint
    weight_map: dict[str, str] | None  # tensor name -> file, from the index; None for a single file
    single_file: str | None  # the one weight file, None for a sharded checkpoint


def _read_layout(source: CheckpointSource) -> _Layout:
    """Finds the checkpoint's weight files (fetching the index json when sharded).

    Raises FileNotFoundError when there are none, ValueError when the index is malformed.
    """
    files = source.files()
    for index, single, fmt in _LAYOUTS:
        if index in files:
            path = source.fetch(index)
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} of {source} is not a valid index: {e!r}") from e
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise ValueError(f"{index} of {source}: 'weight_map' must map tensor names to file names")
            return _Layout(fmt, index, weight_map, None)
        if single in files:
            return _Layout(fmt, None, None, single)
    raise FileNotFoundError(
        f"no weight files in {source}: expected one of {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, "
        f"{BIN_INDEX} or {BIN_SINGLE}"
    )


def _select(layout: _Layout, wanted: Wanted) -> dict[str, set[str] | None]:
    """Weight file -> the wanted tensor names (as stored) it holds (None: a single file, filtered while reading).

    Files are in sorted order; files holding no wanted tensor are absent.
    """
    if layout.weight_map is None:
        assert layout.single_file is not None
        return {layout.single_file: None}
    selection: dict[str, set[str]] = {}
    for name, filename in layout.weight_map.items():
        if wanted(name):
            selection.setdefault(filename, set()).add(name)
    return {filename: selection[filename] for filename in sorted(selection)}


def checkpoint_files_for(
    model: str,
    wanted: Wanted,
    *,
    cache_dir: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    hub: HubFiles | None = None,
) -> list[str]:
    """The weight files (names relative to the checkpoint root, sorted) that hold tensors satisfying `wanted`.

    For a sharded checkpoint this reads only the index: the list is exactly the shards that hold
    wanted tensors, and empty when `wanted` matches nothing. A single-file checkpoint always
    answers its one file, unopened. `hub` substitutes the hub client (tests); leave it None.

    Raises:
        FileNotFoundError: no weight files, or `model` is neither a directory nor a reachable repo.
        ValueError: the index json is malformed.
    """
    source = CheckpointSource(model, cache_dir=cache_dir, revision=revision, token=token, hub=hub)
    return list(_select(_read_layout(source), wanted))


def load_tensors(
    model: str,
    wanted: Wanted,
    *,
    dtype: torch.dtype | None = None,
    cache_dir: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    max_disk_space: int | None = None,
    hub: HubFiles | None = None,
    rename: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """Loads only the tensors whose checkpoint names satisfy `wanted`, as CPU tensors.

    `model` is a local directory (it wins when it exists) or a hub repo id. Only the weight files
    holding wanted tensors are opened, and for a hub repo only those are downloaded, into
    `cache_dir` (default ``$COROLLA_CACHE`` or ``~/.cache/corolla``); `max_disk_space` (bytes)
    caps corolla's files there, evicting the least recently used ones that this load does not
    need. Floating-point tensors are cast to `dtype` when given; integer tensors keep theirs.
    `rename` maps each stored name to the name `wanted` sees and the result is keyed by (a family's
    canonical naming, e.g. BLOOM checkpoints saved with or without the ``transformer.`` prefix).
    The returned tensors own their memory (nothing stays memory-mapped). `hub` substitutes the
    hub client (tests); leave it None.

    Raises:
        FileNotFoundError: no weight files, or `model` is neither a directory nor a reachable repo.
        ValueError: `wanted` matches no tensor, or an index names a tensor its shard lacks.
        DiskSpaceError: the needed files cannot fit under `max_disk_space`.
    """
    source = CheckpointSource(
        model, cache_dir=cache_dir, revision=revision, token=token, max_disk_space=max_disk_space, hub=hub
    )
    if rename is not None:
        wanted_canonical = wanted
        wanted = lambda name: wanted_canonical(rename(name))  # noqa: E731
    layout = _read_layout(source)
    selection = _select(layout, wanted)
    if not selection:
        raise ValueError(
            f"no tensor of {source} matches `wanted` (checked {len(layout.weight_map or {})} names "
            f"in {layout.index_file})"
        )
    keep = set(selection) | ({layout.index_file} if layout.index_file else set())
    source.make_room(list(selection), keep=keep)  # fail before downloading anything
    show_progress = not source.is_local and len(selection) > 1
    tensors: dict[str, torch.Tensor] = {}
    for filename in tqdm(
        list(selection), desc="checkpoint files", unit="file", disable=None if show_progress else True
    ):
        path = source.fetch(filename, keep=keep)
        names = selection[filename]
        read = read_safetensors if layout.format == "safetensors" else read_bin
        loaded = read(path, names.__contains__ if names is not None else wanted, dtype)
        if names is not None and (missing := names - loaded.keys()):
            raise ValueError(
                f"{layout.index_file} of {source} places {sorted(missing)[:5]} in {filename}, "
                f"which lacks them"
            )
        logger.debug("checkpoint.read file=%s tensors=%d", filename, len(loaded))
        tensors.update(loaded)
    if not tensors:
        raise ValueError(f"no tensor of {source} matches `wanted` (checked every name in {layout.single_file})")
    logger.info("checkpoint.loaded source=%s tensors=%d files=%d", source, len(tensors), len(selection))
    if rename is not None:
        renamed = {rename(name): tensor for name, tensor in tensors.items()}
        if len(renamed) != len(tensors):
            raise ValueError(f"{source} stores some tensors under two names that mean the same tensor")
        return renamed
    return tensors


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None, *, copy: bool) -> torch.Tensor:
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.to(dtype=target, copy=copy)


def read_safetensors(path: Path, keep: Wanted, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `path` whose names satisfy `keep`, read key by key."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            if keep(name):
                out[name] = _cast(f.get_tensor(name), dtype, copy=False)  # get_tensor already copies
    return out


def read_bin(path: Path, keep: Wanted, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors of the torch.save'd state dict in `path` whose names satisfy `keep`.

    The file is memory-mapped, so only the wanted tensors' bytes are read; each is copied out so
    that the result does not pin the mapping. Old (pre-zip) files cannot be mapped and are read whole.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        logger.warning("checkpoint.no_mmap file=%s: legacy format, reading it whole", path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    return {
        name: _cast(tensor, dtype, copy=True)
        for name, tensor in state.items()
        if isinstance(tensor, torch.Tensor) and keep(name)
    }
