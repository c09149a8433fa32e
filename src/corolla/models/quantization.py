"""Weight quantization of served blocks (``corolla serve --quant none|int8|nf4``) and their resident memory; spot
checks use it too, to compute a span as a server of a claimed quantization does (`block_as_kind`).

After a block's weights are loaded in the server dtype, ``quantize_block`` swaps its big matmuls for
bitsandbytes modules that keep the weights compressed and compute in the server dtype:

    int8: ``bnb.nn.Linear8bitLt`` (LLM.int8(): int8 row-wise weights, fp16 outlier columns of the input
          above ``threshold`` computed unquantized);                                    ~1 byte per weight
    nf4:  ``bnb.nn.Linear4bit(quant_type="nf4")``: 4-bit NormalFloat in blocks of 64 weights, the per-block
          absmax itself quantized to 8 bits (double quantization);                     ~0.52 byte per weight

What is quantized, in every family: each ``nn.Linear`` of the block (attention projections: Llama's
q/k/v/o_proj, BLOOM's and Falcon's fused query_key_value and dense; the MLP: gate/up/down_proj,
dense_h_to_4h/dense_4h_to_h) and Mixtral's expert weights. What is not: norms, biases (kept in the server
dtype) and MoE routers (``gate``: E outputs, a tiny matmul whose top-k choice flips on small errors, and a
flipped expert costs far more accuracy than the memory it saves).

Mixtral keeps its experts fused in two 3-D parameters, ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I).
They are split into per-expert quantized linears (``QuantizedExperts``), each expert's (2I, H) and (H, I)
matrices quantized on their own, with the same ``forward(x, expert)`` as ``MixtralExperts``; so routing
and the weighted sum are unchanged and the only difference from the float path is each weight's
quantization error.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from corolla.models.mixtral.block import MixtralExperts
from corolla.protocol.messages import QUANT_MODES, QuantMode

logger = logging.getLogger(__name__)


INT8_THRESHOLD = 6.0  # LLM.int8() outlier threshold: input columns above it are computed in fp16
NF4_BLOCKSIZE = 64  # weights per absmax block (bitsandbytes' default)
NF4_NESTED_BLOCKSIZE = 256  # absmax values per block of the double quantization (fixed by bitsandbytes)
_SKIPPED_LINEARS = frozenset({"gate"})  # MoE routers (see the module docstring)


def check_quant_mode(mode: str) -> QuantMode:
    """``mode`` as a ``QuantMode`` (which compares equal to its string); ``ValueError`` listing them if unknown."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    return QuantMode(mode)


class QuantizedExperts(nn.Module):
    """Mixtral's E SwiGLU experts as per-expert quantized linears; ``forward`` is ``MixtralExperts.forward``'s.

    ``gate_up[e]``: H -> 2I (rows [0, I) = w1, the gate; [I, 2I) = w3, the up projection), ``down[e]``: I -> H.
    """

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.intermediate_size = intermediate_size

    def forward(self, x: Tensor, expert: int) -> Tensor:
        """Expert ``expert`` on tokens ``x`` (n, H) -> (n, H): ``w2(silu(w1 x) * w3 x)``."""
        gate, up = self.gate_up[expert](x).chunk(2, dim=-1)  # each (n, I)
        return self.down[expert](F.silu(gate) * up)  # (n, H)


def _bnb():  # imported on use: bitsandbytes is slow to import and only quantized servers need it
    import bitsandbytes as bnb

    return bnb


def _quantized_linear(weight: Tensor, bias: Tensor | None, mode: QuantMode, device: torch.device,
                      compute_dtype: torch.dtype) -> nn.Module:
    """A bitsandbytes linear computing ``x @ weight.T + bias`` with ``weight`` (out, in) quantized on ``device``.

    bitsandbytes quantizes when a parameter moves to a device, and Int8Params only when it moves from the CPU:
    the float weight is therefore staged on the CPU first.
    """
    bnb = _bnb()
    out_features, in_features = weight.shape
    staged = weight.detach().to("cpu").contiguous()  # (out, in) float
    if mode == "int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None, has_fp16_weights=False,
                                    threshold=INT8_THRESHOLD, device="meta")
        layer.weight = bnb.nn.Int8Params(staged, requires_grad=False, has_fp16_weights=False).to(device)
    else:
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                                  compress_statistics=True, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(staged, requires_grad=False, blocksize=NF4_BLOCKSIZE,
                                         compress_statistics=True, quant_type="nf4").to(device)
        # on AVX512-BF16 CPUs bitsandbytes repacks nf4 weights at the first forward, in blocks of 32 output rows and of
        # whole quantization blocks along the input, and fails on other shapes (the demo model's MLP is 688 wide):
        # such layers take its plain path
        if out_features % 32 or in_features % NF4_BLOCKSIZE:
            layer.support_avx512bf16_for_cpu = False
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(device, compute_dtype), requires_grad=False)
    return layer


def _quantized_experts(experts: MixtralExperts, mode: QuantMode, device: torch.device,
                       compute_dtype: torch.dtype) -> QuantizedExperts:
    n_experts = experts.gate_up_proj.shape[0]
    gate_up = [_quantized_linear(experts.gate_up_proj[e], None, mode, device, compute_dtype) for e in range(n_experts)]
    down = [_quantized_linear(experts.down_proj[e], None, mode, device, compute_dtype) for e in range(n_experts)]
    return QuantizedExperts(gate_up, down, experts.intermediate_size)


def _is_quantized_module(module: nn.Module) -> bool:
    if not type(module).__module__.startswith("bitsandbytes"):  # cheap test first: no bitsandbytes import
        return False
    bnb = _bnb()
    return isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))


def _targets(block: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, module) of every module ``quantize_block`` replaces, in ``named_modules`` order."""
    found = []
    for parent in block.modules():
        if _is_quantized_module(parent) or isinstance(parent, QuantizedExperts):
            continue
        for name, child in parent.named_children():
            if isinstance(child, MixtralExperts):
                found.append((parent, name, child))
            elif isinstance(child, nn.Linear) and not _is_quantized_module(child) and name not in _SKIPPED_LINEARS:
                found.append((parent, name, child))
    return found


def quantize_block(block: nn.Module, mode: str, device: torch.device | str, compute_dtype: torch.dtype) -> nn.Module:
    """``block`` on ``device`` with its big matmuls quantized per ``mode`` (module docstring: which, and how).

    ``block`` holds float weights in ``compute_dtype``, best on the CPU (bitsandbytes quantizes while moving
    a weight to its device, so weights on another device are copied to the CPU first). It is modified in
    place and returned; its other parameters (norms, biases, routers) move to ``device`` unchanged.
    ``mode="none"`` only moves it. Quantized linears compute in ``compute_dtype`` and return the input's dtype.
    Raises ``ValueError`` for an unknown mode.
    """
    mode = check_quant_mode(mode)
    device = torch.device(device)
    if mode == "none":
        return block.to(device)
    replaced = 0
    with torch.no_grad():
        for parent, name, child in _targets(block):
            if isinstance(child, MixtralExperts):
                new: nn.Module = _quantized_experts(child, mode, device, compute_dtype)
            else:
                new = _quantized_linear(child.weight, child.bias, mode, device, compute_dtype)
            setattr(parent, name, new)
            replaced += 1
        _move_unquantized(block, device)
    logger.debug("quantized mode=%s modules=%d device=%s", mode, replaced, device)
    return block


def block_as_kind(block: nn.Module, dtype: torch.dtype, mode: str, device: torch.device | str = "cpu") -> nn.Module:
    """A copy of a float32 `block` as a server of compute dtype `dtype` and quantization `mode` holds it: cast, then
    quantized on its way to `device`, exactly as `corolla serve` loads it (server.loading.blocks). `block` is left
    as it was. Quantizing is deterministic, so the copy computes what such a server computes (up to kernels)."""
    return quantize_block(copy.deepcopy(block).to(dtype), mode, device, dtype).eval().requires_grad_(False)


def _move_unquantized(block: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer outside the bitsandbytes modules to ``device``.

    ``block.to(device)`` is avoided: moving an already quantized Int8Params through ``Module._apply`` swaps its
    data but leaves its scales (``SCB``) behind on the old device.
    """
    for module in block.modules():
        if _is_quantized_module(module):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device != device:
                setattr(module, name, nn.Parameter(param.to(device), requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _quant_state_tensors(module: nn.Module) -> list[Tensor]:
    """The tensors a bitsandbytes linear keeps outside its parameters: int8 row scales, nf4 absmax/codebooks."""
    tensors: list[Tensor | None] = []
    weight = getattr(module, "weight", None)
    tensors.append(getattr(weight, "SCB", None))  # Int8Params before the first forward
    state = getattr(module, "state", None)  # Linear8bitLt after it (MatmulLtState)
    if state is not None:
        tensors += [getattr(state, "SCB", None), getattr(state, "CB", None)]
    quant_state = getattr(weight, "quant_state", None)  # Params4bit
    while quant_state is not None:  # nested: state2 quantizes the absmax of the outer state
        tensors += [quant_state.absmax, quant_state.code, getattr(quant_state, "offset", None)]
        quant_state = getattr(quant_state, "state2", None)
    return [t for t in tensors if isinstance(t, Tensor)]


def resident_bytes(module: nn.Module) -> int:
    """Bytes of memory held by ``module``'s parameters, buffers and bitsandbytes quantization state.

    Counted per distinct storage (a tensor and its views, or a weight and the int8 matrix bitsandbytes also
    keeps as ``state.CB``, count once), on whatever devices they live.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    tensors: list[Tensor] = [*module.parameters(), *module.buffers()]
    for sub in module.modules():
        if _is_quantized_module(sub):
            tensors += _quant_state_tensors(sub)
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def quantized_linear_count(block: nn.Module) -> int:
    """Number of bitsandbytes linears in ``block`` (for logs and tests)."""
    return sum(1 for m in block.modules() if _is_quantized_module(m))


def quantized_weight_bytes(out_features: int, in_features: int, mode: str, dtype: torch.dtype) -> int:
    """Resident bytes of one (out, in) weight matrix after ``quantize_block`` (``dtype``: the unquantized one).

    int8: one int8 per weight + one float32 scale per output row.
    nf4: two weights per byte, one uint8 absmax per 64 weights, and for the double quantization one float32
    absmax per 256 of those plus a float32 offset, the 16-entry nf4 codebook and the 256-entry absmax codebook.
    ``test_quantization`` checks these against ``resident_bytes`` of real quantized modules.
    """
    n = out_features * in_features
    mode = check_quant_mode(mode)
    if mode == "none":
        return n * torch.empty((), dtype=dtype).element_size()
    if mode == "int8":
        return n + 4 * out_features
    n_blocks = math.ceil(n / NF4_BLOCKSIZE)
    return math.ceil(n / 2) + n_blocks + 4 * math.ceil(n_blocks / NF4_NESTED_BLOCKSIZE) + 4 + 4 * 16 + 4 * 256


def estimate_block_bytes(block: nn.Module, mode: str, dtype: torch.dtype) -> int:
    """Resident bytes ``block`` would hold after ``.to(dtype)`` and ``quantize_block(block, mode, ...)``.

    ``block`` may live on the meta device (built with ``torch.device("meta")``): only shapes are read. Lets a
    server size how many blocks it takes before loading any weights. Raises ``ValueError`` for an unknown mode.
    """
    mode = check_quant_mode(mode)
    size = torch.empty((), dtype=dtype).element_size()
    tensors = {id(t): t for t in [*block.parameters(), *block.buffers()]}
    total = 0
    if mode != "none":
        for _, _, target in _targets(block):
            if isinstance(target, MixtralExperts):
                n_experts, two_inner, hidden = target.gate_up_proj.shape
                per_expert = quantized_weight_bytes(two_inner, hidden, mode, dtype)
                per_expert += quantized_weight_bytes(hidden, two_inner // 2, mode, dtype)
                total += n_experts * per_expert
                quantized = [target.gate_up_proj, target.down_proj]
            else:
                total += quantized_weight_bytes(target.out_features, target.in_features, mode, dtype)
                quantized = [target.weight]
            for t in quantized:
                tensors.pop(id(t), None)
    for t in tensors.values():
        total += t.numel() * (size if t.is_floating_point() else t.element_size())
    return total
