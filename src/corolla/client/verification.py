"""Spot checks of servers' outputs: the pure decisions (how far apart two honest servers may be, who lied, where
generation must restart). The I/O side (sending the checks, banning, replaying) is client.spot_checks.

A check compares the output a server returned for a span at some positions with the output a *different* server
of the same blocks computes for the same inputs (a cache-less rpc_forward over the span's kept inputs from position
0, so both attend to the same context). The measure is the largest relative L2 error over positions:

    relative_error(a, b) = max_t ||a_t - b_t|| / ||b_t||      (a, b: (B, T, H), t over every row and position)

Honest spread, measured with bench/measure_verify_spread.py (a random-weight Llama, hidden 256, 8 heads, 4 blocks
in the span, 48 tokens, 5 input draws, CPU; the largest error seen for each pair of server configurations):

    pair of servers                                  honest max error   `corrupt` adds   tolerance
    float32 vs float32, 1 vs 2 torch threads         0                  7.3e-3           1e-3  (same kind)
    float32 vs float32 tensor-parallel (2 shards)    8.0e-7             7.3e-3           1e-3  (same kind)
    bfloat16 vs bfloat16, 1 vs 2 threads             0                  7.3e-3           3e-3  (same kind)
    int8 vs int8, nf4 vs nf4 (1 vs 2 threads)        0                  7.3e-3           3e-3  (same kind)
    bfloat16 vs float32                              9.7e-3             (hidden)         2e-2
    int8 vs float32 (or bfloat16)                    2.8e-2             (hidden)         6e-2
    nf4 vs anything else                             3.1e-1             (hidden)         6e-1

`corrupt` (--inject-fault corrupt: half the features of the span's output scaled by 1.01) moves the output by 7.3e-3
against the same server's honest output. So a check catches it only between servers of the same kind (same dtype
and quantization), whose honest outputs agree to 1e-6 or exactly; between kinds the honest spread is larger than
the perturbation, and such a check catches only grosser corruption (about 3x the table's spread). That is why the
checker is chosen among the servers with the smallest pair tolerance (`checker_rank`). Tolerances sit at about 2x
the measured spread for mixed pairs: the spread grows with the span's length and differs for trained weights, so
a swarm with long spans of low-precision servers should be measured again before trusting them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from corolla.protocol.messages import QuantMode, ServerInfo

# tolerances of the relative error (the table above has the measured spread they sit above)
TOL_SAME_EXACT = 1e-3  # two float32 servers: the same math up to summation order (threads, sharding)
TOL_SAME_LOW = 3e-3  # two servers of the same low-precision kind (bfloat16/float16, int8 or nf4 weights)
TOL_EXACT = 1e-3  # a float32 server against exact float32 outputs
TOL_HALF = 2e-2  # float16 / bfloat16 compute against float32
TOL_INT8 = 6e-2  # LLM.int8() weights against float32
TOL_NF4 = 6e-1  # 4-bit NormalFloat weights against float32

Verdict = Literal["agree", "ban_suspect", "ban_checker", "ban_both"]


def relative_error(output: Tensor, reference: Tensor) -> float:
    """max over rows and positions of ||output_t - reference_t|| / ||reference_t|| for (B, T, H) tensors (float32)."""
    a, b = output.float().reshape(-1, output.shape[-1]), reference.float().reshape(-1, reference.shape[-1])
    if a.shape != b.shape:
        return float("inf")
    if a.shape[0] == 0:
        return 0.0
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float(err.max())


def server_tolerance(info: ServerInfo | None) -> float:
    """The relative error one server's honest outputs may have against exact float32 ones; unknown: the loosest."""
    if info is None:
        return TOL_NF4
    quant = QuantMode(info.quant)
    if quant == QuantMode.NF4:
        return TOL_NF4
    if quant == QuantMode.INT8:
        return TOL_INT8
    if info.torch_dtype in ("float16", "bfloat16"):
        return TOL_HALF
    return TOL_EXACT


def server_kind(info: ServerInfo | None) -> tuple[str, str] | None:
    """(compute dtype, quantization) of a server: two servers of one kind compute the same numbers up to summation
    order. float16 and bfloat16 are different kinds."""
    if info is None:
        return None
    return (info.torch_dtype, str(QuantMode(info.quant).value))


def pair_tolerance(a: ServerInfo | None, b: ServerInfo | None) -> float:
    """The tolerance of comparing server a's output with server b's: tight for two servers of the same kind, else
    the larger of their tolerances against float32."""
    kind = server_kind(a)
    if kind is not None and kind == server_kind(b):
        return TOL_SAME_EXACT if server_tolerance(a) == TOL_EXACT else TOL_SAME_LOW
    return max(server_tolerance(a), server_tolerance(b))


def checker_rank(suspect: ServerInfo | None, candidates: list[tuple[str, ServerInfo]]) -> list[tuple[str, ServerInfo]]:
    """The candidates whose pair tolerance with the suspect is the smallest (the checks that can see the most)."""
    if not candidates:
        return []
    best = min(pair_tolerance(suspect, info) for _, info in candidates)
    return [(peer, info) for peer, info in candidates if pair_tolerance(suspect, info) == best]


def decide(suspect_vs_checker: float, tol_suspect_checker: float, suspect_vs_third: float | None = None,
           tol_suspect_third: float = 0.0, checker_vs_third: float | None = None, tol_checker_third: float = 0.0) -> Verdict:
    """Who to ban after a check: `suspect` served the session, `checker` recomputed its outputs, `third` (optional)
    breaks a tie. Errors are relative_error values, each with the tolerance of its pair.

    - suspect and checker agree: "agree".
    - they disagree and no third opinion: "ban_suspect" (the session's outputs cannot be trusted; the checker, which
      nobody depends on yet, keeps its standing).
    - a third server agrees with exactly one of them: the other is banned ("ban_suspect" or "ban_checker").
    - it agrees with neither (or with both, which means the two are near their tolerances): "ban_both" when it
      agrees with neither, "ban_suspect" when with both (the suspect's output is the one in use).
    """
    if suspect_vs_checker <= tol_suspect_checker:
        return "agree"
    if suspect_vs_third is None or checker_vs_third is None:
        return "ban_suspect"
    suspect_ok = suspect_vs_third <= tol_suspect_third
    checker_ok = checker_vs_third <= tol_checker_third
    if suspect_ok and not checker_ok:
        return "ban_checker"
    if checker_ok and not suspect_ok:
        return "ban_suspect"
    if not suspect_ok and not checker_ok:
        return "ban_both"
    return "ban_suspect"


@dataclass(frozen=True)
class Rewind:
    """Generation must restart at session position `position`: the servers keep [0, position), the token there is
    sent again, and every token after it is generated anew."""

    position: int
    peer_id: str  # the server found lying


def rewind_position(first_output: int) -> int:
    """Where to rewind after a server was found wrong: the first position whose output of that server reached the
    rest of the chain (`first_output`, from its SpanSession), not the first position the failed check covered: a
    server caught lying may have lied before, unchecked (a check passed earlier covered only the steps it drew)."""
    return max(first_output, 0)


def sequence_rewind(position: int, prefix_length: int, prompt_len: int, length: int) -> int:
    """The number of sequence columns to keep when the session rewinds to `position`: the tokens of positions
    [prefix_length, position] (the one at `position` was predicted from an honest output), never fewer than the
    caller's own `prompt_len`, never more than `length`."""
    return min(max(position - prefix_length + 1, prompt_len), length)
