"""Loading a server's blocks: how many fit, reading and building them (quantized, tensor-parallel, with adapters)
into a BlockStack, and how many cache tokens to offer by default.

Pure of the server's lifecycle: `Server` calls these with its config, model family and dtype.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from corolla.checkpoint import load_tensors
from corolla.server.loading.adapters import attach_adapters
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.config import ServerConfig
from corolla.models.quantization import estimate_block_bytes, quantize_block, resident_bytes
from corolla.server.compute.tensor_parallel import build_tensor_parallel_block, tensor_parallel_stack

logger = logging.getLogger(__name__)

MAX_DEFAULT_CACHE_TOKENS = 1 << 20


def default_num_blocks(family: Any, model_config: Any, dtype: torch.dtype, dtype_name: str, quant: str) -> int:
    """As many blocks as fit in half of the available memory (all of them for small models), each block's
    size computed from its shapes (a block built on the meta device) in `dtype` and `quant`."""
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            block = family.block_class(model_config, 0)
    finally:
        torch.set_default_dtype(default_dtype)
    bytes_per_block = estimate_block_bytes(block, quant, dtype)
    logger.info(
        "sizing: one block takes about %.1f MiB (dtype %s, quant %s)", bytes_per_block / 2**20, dtype_name, quant
    )
    return max(1, int(available_memory() * 0.5 // bytes_per_block))


def load_stack(
    config: ServerConfig,
    family: Any,
    model_config: Any,
    start: int,
    end: int,
    dtype: torch.dtype,
    dtype_name: str,
    device: torch.device,
) -> tuple[BlockStack, int]:
    """Blocks [start, end) of `config.model` as a BlockStack (tensor-parallel over config.tensor_parallel_devices if
    given), each quantized on its way to its device, with config.adapters attached; and the resident bytes of one
    block (their mean)."""
    begin = time.perf_counter()
    prefixes = [family.block_prefix(i) for i in range(start, end)]
    tensors = load_tensors(
        config.model,
        lambda name: name.startswith(tuple(prefixes)),
        dtype=dtype,
        cache_dir=config.cache_dir,
        max_disk_space=config.max_disk_space,
        rename=family.canonical_name,
    )
    blocks = []
    tp_devices = config.tensor_parallel_devices
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        for index in tqdm(range(start, end), desc="loading blocks", unit="block", disable=None):  # a bar on a terminal
            block = family.load_block(model_config, index, tensors)
            if tp_devices:  # split on the host, then each shard is quantized (if asked) on its way to its device
                block = build_tensor_parallel_block(family, model_config, block.to(dtype), tp_devices, config.quant)
            else:  # quantized (if asked) on its way to the device: a float block never sits on an accelerator
                block = quantize_block(block.to(dtype), config.quant, device, dtype)
            blocks.append(block.eval().requires_grad_(False))
    finally:
        torch.set_default_dtype(default_dtype)
    if config.adapters:
        attach_adapters(
            blocks,
            start,
            config.adapters,
            family,
            model_config,
            dtype=dtype,
            device=device,
            cache_dir=config.cache_dir,
            max_disk_space=config.max_disk_space,
        )
    n_kv_heads, head_dim = family.kv_layout(model_config)
    bytes_per_block = sum(resident_bytes(b) for b in blocks) // len(blocks)
    logger.info(
        "loaded blocks %d:%d in %.1fs (dtype %s, quant %s, %.2f MiB per block)",
        start,
        end,
        time.perf_counter() - begin,
        dtype_name,
        config.quant,
        bytes_per_block / 2**20,
    )
    if tp_devices:
        logger.info("tensor parallel: each block split over %d devices: %s", len(tp_devices), " ".join(tp_devices))
        stack = tensor_parallel_stack(
            blocks, start, model_config.hidden_size, KVLayout(n_kv_heads, head_dim), dtype, config.max_chunk_tokens
        )
        return stack, bytes_per_block
    stack = BlockStack(
        blocks,
        start,
        model_config.hidden_size,
        KVLayout(n_kv_heads, head_dim),
        dtype,
        device,
        config.max_chunk_tokens,
        cache_length=functools.partial(family.cache_length, model_config),
    )
    length = config.max_session_length
    full, kept = (stack.layout.bytes_per_token(dtype, len(blocks)) * length, stack.cache_bytes(1, length, start, end))
    if kept < full:
        logger.info(
            "cache: sliding-window blocks keep a ring of recent positions; a session of %d tokens takes "
            "%.1f MiB, not %.1f MiB (the budget still reserves batch x max_length tokens of every block)",
            length,
            kept / 2**20,
            full / 2**20,
        )
    return stack, bytes_per_block


def default_cache_tokens(stack: BlockStack, dtype: torch.dtype, num_blocks: int) -> int:
    """Cache tokens (of all `num_blocks` blocks) that fit in a quarter of the available memory, at most 2^20."""
    per_token = stack.layout.bytes_per_token(dtype, num_blocks)
    return int(min(MAX_DEFAULT_CACHE_TOKENS, available_memory() * 0.25 // per_token))


def available_memory() -> int:
    """Bytes of memory available to new allocations (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
