"""Measuring how fast this server computes, cached on disk per model shape, device and dtype."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)


def default_cache_path() -> Path:
    return Path(os.environ.get("COROLLA_CACHE", Path.home() / ".cache" / "corolla")) / "throughput.json"


def measure_block_throughput(
    block: nn.Module, hidden_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    steps: int = 20,
) -> float:
    """Single-token decode steps per second through one block (median of `steps` timed runs after a warm-up)."""
    cache = (
        torch.zeros(1, n_kv_heads, steps + 4, head_dim, dtype=dtype, device=device),
        torch.zeros(1, n_kv_heads, steps + 4, head_dim, dtype=dtype, device=device),
    )
    x = torch.randn(1, 1, hidden_size, dtype=dtype, device=device)
    times = []
    with torch.inference_mode():
        for position in range(steps + 2):
            begin = time.perf_counter()
            block(x, cache, position)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
    times = sorted(times[2:])
    return 1.0 / max(times[len(times) // 2], 1e-6)


def cached_throughput(key_parts: dict[str, object], measure, path: Path | None = None) -> float:
    """Return the throughput stored under these key parts, measuring (and storing) it when absent."""
    stored = load_cached(key_parts, path=path)
    if stored is not None:
        return stored
    value = float(measure())
    store_cached(key_parts, value, path=path)
    return value


def load_cached(key_parts: dict[str, object], max_age: float | None = None, path: Path | None = None) -> float | None:
    """The value stored under these key parts, if there is one no older than `max_age` seconds."""
    entry = _read(path or default_cache_path()).get(_key(key_parts))
    if isinstance(entry, (int, float)):  # written without a timestamp: compute speed, which does not age
        return float(entry) if max_age is None else None
    if isinstance(entry, dict) and isinstance(entry.get("value"), (int, float)):
        if max_age is None or time.time() - float(entry.get("at", 0.0)) <= max_age:
            return float(entry["value"])
    return None


def store_cached(key_parts: dict[str, object], value: float, path: Path | None = None) -> None:
    """Store a measured value (with the time it was measured) under these key parts; best effort."""
    path = path or default_cache_path()
    stored = _read(path)
    stored[_key(key_parts)] = {"value": float(value), "at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not cache a measurement at %s: %s", path, e)


def _key(key_parts: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}
