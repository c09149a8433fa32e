"""Benchmark: a server's blocks unquantized, int8 and nf4 — resident memory per block and decode speed.

In-process, on the server's own code path: the blocks are read from the checkpoint with corolla's loader,
quantized with `corolla.models.quantization.quantize_block` (as `corolla serve --quant MODE` does) and run
through `BlockStack.inference_step` with a KV cache (as the server runs a session's steps): batch 1, a
prompt of --prompt-tokens tokens (prefill), then --new-tokens single-token decode steps fed with random hidden
states (no embeddings or LM head: only the served blocks are measured). Median of --repeats timed runs after one
warm-up run. Prints one JSON object on stdout; progress goes to stderr.

    python bench/bench_quant.py                        # tinyllama8 (8 layers of TinyLlama-1.1B), float32, 1 thread
    python bench/bench_quant.py --modes none,nf4 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import build_model, log  # noqa: E402  (the same cached checkpoints)

from corolla.checkpoint import load_config, load_tensors  # noqa: E402
from corolla.models import get_family  # noqa: E402
from corolla.server.compute.block_stack import BlockStack, KVLayout  # noqa: E402
from corolla.models.quantization import estimate_block_bytes, quantize_block, resident_bytes  # noqa: E402


def load_stack(path: Path, mode: str, dtype: torch.dtype) -> tuple[BlockStack, float]:
    """Every block of the checkpoint at `path`, quantized per `mode`, as a BlockStack; and the load time, s."""
    begin = time.perf_counter()
    config = load_config(str(path))
    family = get_family(config)
    n_blocks = family.num_blocks(config)
    prefixes = tuple(family.block_prefix(i) for i in range(n_blocks))
    tensors = load_tensors(str(path), lambda name: name.startswith(prefixes), dtype=dtype, rename=family.canonical_name)
    blocks = []
    for index in range(n_blocks):
        block = family.load_block(config, index, tensors)
        for name in [n for n in tensors if n.startswith(family.block_prefix(index))]:
            del tensors[name]  # free the checkpoint copy as we go
        blocks.append(quantize_block(block.to(dtype), mode, "cpu", dtype).eval().requires_grad_(False))
    n_kv_heads, head_dim = family.kv_layout(config)
    stack = BlockStack(blocks, 0, config.hidden_size, KVLayout(n_kv_heads, head_dim), dtype, torch.device("cpu"))
    return stack, time.perf_counter() - begin


def time_generation(stack: BlockStack, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    """Median prefill seconds and decode ms/token over `repeats` runs, each with a fresh cache."""
    n = len(stack.blocks)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, prompt_tokens, stack.hidden_size, generator=generator, dtype=stack.dtype)  # (1, T, H)
    steps = torch.randn(new_tokens, 1, 1, stack.hidden_size, generator=generator, dtype=stack.dtype)  # each (1, 1, H)

    def run_once() -> tuple[float, float]:
        cache = stack.allocate_cache(1, prompt_tokens + new_tokens, 0, n)
        begin = time.perf_counter()
        stack.inference_step(prompt, cache, 0)
        prefill = time.perf_counter() - begin
        begin = time.perf_counter()
        for i in range(new_tokens):
            stack.inference_step(steps[i], cache, prompt_tokens + i)
        return prefill, (time.perf_counter() - begin) / new_tokens

    run_once()  # warm-up (bitsandbytes sets up its state on the first forward)
    runs = [run_once() for _ in range(repeats)]
    return {
        "prefill_s": round(statistics.median(r[0] for r in runs), 4),
        "decode_ms_per_token": round(statistics.median(r[1] for r in runs) * 1e3, 2),
        "decode_runs_ms": [round(r[1] * 1e3, 2) for r in runs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tinyllama8", help="a model name of bench_generate.py")
    parser.add_argument("--modes", default="none,int8,nf4", help="comma-separated quantization modes")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="server compute dtype")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median reported)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per run")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prefill length")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--cache-dir", default=os.environ.get("COROLLA_BENCH_CACHE", "/tmp/corolla-bench"),
                        help="where the benchmark checkpoints are built and reused")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results: dict[str, object] = {
        "model": args.model, "dtype": args.dtype, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "load_average_1min": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory(prefix="corolla-bench-") as tmp:
        path = build_model(args.model, Path(args.cache_dir), Path(tmp))
        for mode in args.modes.split(","):
            log(f"{mode}: loading and quantizing")
            stack, load_s = load_stack(path, mode, dtype)
            per_block = [resident_bytes(b) for b in stack.blocks]
            config = load_config(str(path))
            with torch.device("meta"):
                estimate = estimate_block_bytes(get_family(config).block_class(config, 0).to(dtype), mode, dtype)
            log(f"{mode}: timing")
            timing = time_generation(stack, args.prompt_tokens, args.new_tokens, args.repeats)
            after = [resident_bytes(b) for b in stack.blocks]  # bitsandbytes may repack weights on first use
            results[mode] = {
                "bytes_per_block": int(statistics.mean(per_block)),
                "bytes_per_block_after_forward": int(statistics.mean(after)),
                "mib_per_block": round(statistics.mean(per_block) / 2**20, 2),
                "estimated_bytes_per_block": estimate,
                "load_and_quantize_s": round(load_s, 2),
                **timing,
            }
            log(f"{mode}: {results[mode]}")
            del stack
            gc.collect()
    base = results.get("none")
    for mode in args.modes.split(","):
        if mode != "none" and isinstance(base, dict):
            entry = results[mode]
            assert isinstance(entry, dict)
            entry["memory_ratio_vs_none"] = round(base["bytes_per_block"] / entry["bytes_per_block"], 2)
            entry["decode_slowdown_vs_none"] = round(entry["decode_ms_per_token"] / base["decode_ms_per_token"], 2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
