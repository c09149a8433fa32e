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
    path = path or default_cache_path()
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if isinstance(stored.get(key), (int, float)):
        return float(stored[key])
    value = float(measure())
    stored[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not cache throughput at %s: %s", path, e)
    return value
