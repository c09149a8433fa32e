"""Spot checks of servers' outputs: the pure decisions (which checker, which tolerance, who lied, where generation
must restart). The I/O side (sending the checks, banning, replaying) is client.trust.spot_checks.

A check compares the output a server (the *suspect*) returned for a span at some positions with the output another
server (the *checker*) computes for the same inputs (a cache-less rpc_forward over the span's kept inputs from
position 0, so both attend to the same context). The measure is the largest relative L2 error over positions:

    relative_error(a, b) = max_t ||a_t - b_t|| / ||b_t||      (a, b: (B, T, H), t over every row and position)

Like with like. A server's *kind* is its compute dtype and quantization (ComputeKind). Honest servers of one kind
agree to summation order; across kinds they differ by up to the lower precision's error (the table), so a suspect
checked against another kind could hide a lie in that spread, and could *choose* the spread by what it announces
(a float32 server announcing nf4 would be granted 0.6). So a check is always made in the suspect's own claimed kind
when that is possible (`plan_checkers`): by a server of that kind, else by a server with float32 weights computing
as that kind (ForwardRequest.emulate: it quantizes its weights exactly as such a server does), each within the tight
tolerance of the kind. A claim the outputs contradict (announcing nf4 while computing float32) fails such a check
like any other lie. Only when no server can compute the suspect's kind is the wide cross-kind tolerance used.

One word never convicts. Suspect and checker disagreeing convicts neither: further opinions settle it (`third_opinion`),
each also computed in the suspect's kind: another holder of the span agreeing with exactly one of them convicts the
other; when none does, the client computes the span itself from the checkpoint (client.trust.referee) and everything that
disagrees with it is wrong (`referee_verdict`). Until something settles it the dispute stands and the session
reports its output as unverified.

Honest spread, measured with bench/measure_verify_spread.py (a random-weight Llama, hidden 256, 8 heads, 4 blocks
in the span, 48 tokens, 5 input draws, CPU; the largest error seen for each pair of server configurations):

    pair of servers                                  honest max error   `corrupt` adds   tolerance
    float32 vs float32, 1 vs 2 torch threads         0                  7.3e-3           1e-3  (same kind)
    float32 vs float32 tensor-parallel (2 shards)    8.0e-7             7.3e-3           1e-3  (same kind)
    bfloat16 vs bfloat16, 1 vs 2 threads             0                  7.3e-3           1e-2  (same kind)
    int8 vs int8, nf4 vs nf4 (1 vs 2 threads)        0                  7.3e-3           1e-2  (same kind)
    int8 / nf4 / bfloat16 vs float32 emulating it    0                  7.3e-3           1e-2  (same kind)
    bfloat16 vs float32                              9.7e-3             (hidden)         2e-2
    int8 vs float32 (or bfloat16)                    2.8e-2             (hidden)         6e-2
    nf4 vs anything else                             3.1e-1             (hidden)         6e-1

Same-kind tolerances of low-precision kinds are 1e-2 although the measured spread on one CPU is 0: servers and
checkers run on different hardware, whose bf16 and quantized kernels round differently. `corrupt` (--inject-fault
corrupt: half the features of the span's output scaled by 1.01) moves the output by 7.3e-3: caught between float32
servers, and within the low-precision kinds' 1e-2; grosser lies (`false-quant` adds ~7e-2) are caught in every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from corolla.protocol.messages import ComputeKind, QuantMode, ServerInfo

EXACT = ComputeKind(dtype="float32")  # the kind of float32, unquantized servers

# tolerances of the relative error (the table above has the measured spread they sit above)
TOL_SAME_EXACT = 1e-3  # two float32 servers: the same math up to summation order (threads, sharding)
TOL_SAME_LOW = 1e-2  # two servers of one low-precision kind (bfloat16/float16, int8 or nf4), maybe on other hardware
TOL_EXACT = 1e-3  # a float32 server against exact float32 outputs
TOL_HALF = 2e-2  # float16 / bfloat16 compute against float32
TOL_INT8 = 6e-2  # LLM.int8() weights against float32
TOL_NF4 = 6e-1  # 4-bit NormalFloat weights against float32

# what a session's codec (protocol.codecs) may add to the relative error of an output that crossed the wire in it
# once: about 2x the codec's error measured on activations with outliers (tests/unit/test_codecs.py)
CODEC_TOLERANCE = {"none": 0.0, "bf16": 1e-2, "fp16": 2e-3, "int8": 5e-2, "4bit": 4e-1, "deflate": 0.0}

Verdict = Literal["agree", "ban_suspect", "ban_checker", "ban_both", "dispute"]


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


def codec_tolerance(codec: str) -> float:
    """How much a session's codec widens its checks' tolerances: only what the client chose to lose."""
    return CODEC_TOLERANCE[codec]


def kind_of(info: ServerInfo | None) -> ComputeKind | None:
    """The kind (compute dtype, quantization) a server announces; None for an unknown server or dtype."""
    if info is None or info.torch_dtype not in ("float32", "bfloat16", "float16"):
        return None
    return ComputeKind(dtype=info.torch_dtype, quant=QuantMode(info.quant))


def kind_tolerance(kind: ComputeKind | None) -> float:
    """The tolerance between two outputs computed as one kind: float32 is exact up to summation order."""
    return TOL_SAME_EXACT if kind == EXACT else TOL_SAME_LOW


def _tolerance_vs_exact(kind: ComputeKind | None) -> float:
    if kind is None or kind.quant == QuantMode.NF4:
        return TOL_NF4
    if kind.quant == QuantMode.INT8:
        return TOL_INT8
    return TOL_HALF if kind.dtype in ("float16", "bfloat16") else TOL_EXACT


def opinion_tolerance(a: ComputeKind | None, b: ComputeKind | None) -> float:
    """The tolerance of comparing an output computed as kind `a` with one computed as kind `b`: the kind's tight one
    when they are the same kind, else the larger of their errors against float32."""
    if a is not None and a == b:
        return kind_tolerance(a)
    return max(_tolerance_vs_exact(a), _tolerance_vs_exact(b))


def server_tolerance(info: ServerInfo | None) -> float:
    """The relative error one server's honest outputs may have against exact float32 ones; unknown: the loosest."""
    return _tolerance_vs_exact(kind_of(info))


def pair_tolerance(a: ServerInfo | None, b: ServerInfo | None) -> float:
    """The tolerance of comparing server a's own output with server b's own output (see opinion_tolerance)."""
    return opinion_tolerance(kind_of(a), kind_of(b))


@dataclass(frozen=True)
class CheckPlan:
    """One server's opinion on a suspect's output: who computes it, whether as the suspect's kind (`emulate`), and
    the kind its output is then computed as (`kind`)."""

    peer_id: str
    info: ServerInfo
    emulate: ComputeKind | None  # ForwardRequest.emulate: compute as this kind (None: as the server itself computes)
    kind: ComputeKind | None  # the kind of the opinion's numbers


def can_emulate(info: ServerInfo) -> bool:
    """Whether a server can compute as another kind: float32, unquantized weights and no adapters (server.compute.emulation)."""
    return kind_of(info) == EXACT and not info.adapters


def plan_checkers(suspect: ServerInfo | None, candidates: list[tuple[str, ServerInfo]], emulation: bool = True
                  ) -> list[list[CheckPlan]]:
    """The ways the candidates can give an opinion on `suspect`'s output, in tiers, best first: servers of the
    suspect's kind; servers computing as its kind (`emulation`: allowed for this request); every other server, in
    its own kind (the wide cross-kind tolerance; used only when the tiers above are empty). Within a tier, the
    caller picks at random."""
    kind = kind_of(suspect)
    same, emulating, others = [], [], []
    for peer, info in candidates:
        own = kind_of(info)
        if kind is not None and own == kind:
            same.append(CheckPlan(peer, info, None, kind))
        elif kind is not None and emulation and can_emulate(info):
            emulating.append(CheckPlan(peer, info, kind, kind))
        else:
            others.append(CheckPlan(peer, info, None, own))
    tiers = [tier for tier in (same, emulating) if tier]
    return tiers or ([others] if others else [])


def third_opinion(suspect_vs_third: float, tol_suspect_third: float, checker_vs_third: float, tol_checker_third: float
           ) -> Verdict:
    """What a third opinion says of a suspect and a checker that disagree: it agrees with exactly one of them (the
    other is banned), or with neither or both ("dispute": it settles nothing)."""
    suspect_ok = suspect_vs_third <= tol_suspect_third
    checker_ok = checker_vs_third <= tol_checker_third
    if suspect_ok and not checker_ok:
        return "ban_checker"
    if checker_ok and not suspect_ok:
        return "ban_suspect"
    return "dispute"


def referee_verdict(suspect_vs_referee: float, tol_suspect: float, checker_vs_referee: float, tol_checker: float
                    ) -> Verdict:
    """The client's own computation decides: whoever disagrees with it is banned, both if both do."""
    suspect_ok = suspect_vs_referee <= tol_suspect
    checker_ok = checker_vs_referee <= tol_checker
    if suspect_ok and checker_ok:
        return "agree"
    if suspect_ok:
        return "ban_checker"
    return "ban_suspect" if checker_ok else "ban_both"


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
