"""Computing a span as a server of another kind would: what spot checks ask for to compare like with like.

A suspect announcing bfloat16, int8 or nf4 may differ from float32 outputs by up to its kind's honest error (~1e-2 to
~3e-1), so a check against a float32 checker could only use that wide tolerance, and a liar could hide a bias in it
by announcing the loosest kind. Instead the client asks a checker to compute *as* the suspect's kind
(ForwardRequest.emulate): a server holding float32 weights casts and quantizes a copy of the span's blocks exactly as
`corolla serve --dtype D --quant Q` loads them (models.quantization.block_as_kind) and runs the forward with those;
honest servers of one kind agree to summation order, so the check uses that kind's tight tolerance.

Only a server whose own blocks are float32 and unquantized, without tensor parallelism, can emulate (a quantized or
half-precision server has lost what the others were quantized from); others refuse with a clear error. The copies of
the last span emulated are kept (one span, one kind) for the next check, whose suspect is usually the same.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from corolla.models.quantization import block_as_kind
from corolla.protocol.messages import ComputeKind
from corolla.server.compute.forward_backward import run_blocks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Emulator:
    """Forwards of a server's blocks [start, end) as another kind; run on the compute thread."""

    def __init__(self, blocks: list[nn.Module], start: int, own: ComputeKind, device: torch.device, enabled: bool):
        self.blocks = blocks
        self.start = start
        self.own = own
        self.device = device
        self.enabled = enabled and own == ComputeKind(dtype="float32")  # only float32 weights can become any kind
        self._cached: tuple[tuple[int, int, ComputeKind], list[nn.Module]] | None = None
        self._lock = threading.Lock()

    def problem(self, kind: ComputeKind) -> str | None:
        """None if this server can compute as `kind`, else why not."""
        if kind == self.own:
            return None
        if not self.enabled:
            return (f"this server cannot compute as {kind.dtype}/{kind.quant.value}: only servers with float32, "
                    "unquantized blocks (and no tensor parallelism) can")
        return None

    def forward(self, hidden: Tensor, start: int, end: int, kind: ComputeKind) -> Tensor:
        """A cache-less forward of hidden (B, T, H) through blocks [start, end) as a server of `kind` computes it,
        returned in hidden's dtype. The caller checked `problem(kind)`."""
        dtype = DTYPES[kind.dtype]
        blocks = self._blocks(start, end, kind)
        with torch.inference_mode():
            return run_blocks(blocks, hidden.to(self.device, dtype)).to(hidden.dtype)

    def _blocks(self, start: int, end: int, kind: ComputeKind) -> list[nn.Module]:
        with self._lock:
            if self._cached is not None and self._cached[0] == (start, end, kind):
                return self._cached[1]
            self._cached = None  # one span of copies at a time: free the old ones before making new ones
            made = [block_as_kind(block, DTYPES[kind.dtype], kind.quant.value, self.device)
                    for block in self.blocks[start - self.start : end - self.start]]
            self._cached = ((start, end, kind), made)
            return made
