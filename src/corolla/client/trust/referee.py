"""The client as the referee of a dispute: it computes a disputed span itself, from the checkpoint.

Two servers that disagree on a span convict neither (client.trust.verification). When no other server holds the span
to give a third opinion, the client reads the span's blocks from the same checkpoint the servers load (only that
span, only on dispute: a large model's span may be gigabytes of shards to fetch) and computes the span as the
suspect's kind would (models.quantization.block_as_kind: cast and quantize exactly as `corolla serve` does). Its
answer is not one more peer's word: anything that disagrees with it is wrong.

The float32 blocks of the last span read are kept (one span), so a session's further disputes on it cost only the
compute. Everything runs in a worker thread, off the client's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch
from torch import Tensor, nn

from corolla.checkpoint import load_tensors
from corolla.models.quantization import block_as_kind
from corolla.protocol.messages import ComputeKind

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Referee:
    """Computes spans of model `model` (a hub repo or a directory, as the servers load it) on the client's CPU."""

    def __init__(self, model: str, family: Any, model_config: Any, cache_dir: str | None = None,
                 revision: str | None = None, token: str | None = None):
        self.model = model
        self.family = family
        self.model_config = model_config
        self.cache_dir = cache_dir
        self.revision = revision
        self.token = token
        self.computed = 0  # spans computed so far (for tests and logs)
        self._span: tuple[tuple[int, int], list[nn.Module]] | None = None
        self._lock = threading.Lock()

    async def forward(self, hidden: Tensor, start: int, end: int, kind: ComputeKind) -> Tensor:
        """A cache-less forward of hidden (B, T, H) through blocks [start, end), computed as a server of `kind`
        computes it, in hidden's dtype. Raises what reading the checkpoint raises (OSError, ValueError)."""
        return await asyncio.to_thread(self._forward, hidden, start, end, kind)

    def _forward(self, hidden: Tensor, start: int, end: int, kind: ComputeKind) -> Tensor:
        dtype = DTYPES[kind.dtype]
        with self._lock:
            blocks = [block_as_kind(block, dtype, kind.quant.value) for block in self._float_blocks(start, end)]
            self.computed += 1
        x = hidden.to(dtype)
        with torch.inference_mode():
            for block in blocks:
                x = block(x, None, 0)  # (B, T, H): a cache-less causal pass, as server.compute.forward_backward.run_blocks does
        return x.to(hidden.dtype)

    def _float_blocks(self, start: int, end: int) -> list[nn.Module]:
        if self._span is not None and self._span[0] == (start, end):
            return self._span[1]
        self._span = None
        logger.info("referee: reading blocks %d:%d of %s to settle a dispute", start, end, self.model)
        prefixes = tuple(self.family.block_prefix(i) for i in range(start, end))
        tensors = load_tensors(self.model, lambda name: name.startswith(prefixes), dtype=torch.float32,
                               cache_dir=self.cache_dir, revision=self.revision, token=self.token,
                               rename=self.family.canonical_name)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float32)
            blocks = [self.family.load_block(self.model_config, i, tensors).float().eval().requires_grad_(False)
                      for i in range(start, end)]
        finally:
            torch.set_default_dtype(default_dtype)
        self._span = ((start, end), blocks)
        return blocks
