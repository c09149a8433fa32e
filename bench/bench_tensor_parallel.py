"""Benchmark: the server's decode step through a span of blocks, unsharded vs split over N tensor-parallel devices.

Engine only (no network, no client): the blocks of a Qwen3-0.6B-shaped model (hidden 1024, 16 heads / 8 KV heads,
head_dim 128, FFN 3072; random weights, float32, built in memory) run as a `BlockStack` and as
`tensor_parallel_stack`s over `--devices` (default "cpu" repeated: every shard on the same CPU, the correctness path).
Per configuration: a `--prompt-tokens` prefill, then `--new-tokens` single-token cached steps; reports the median
decode ms/token and prefill time over `--repeats` interleaved runs, and the largest difference of any step's output
from the unsharded stack's.

    python bench/bench_tensor_parallel.py                       # 1 (unsharded), 2 and 3 shards on cpu
    python bench/bench_tensor_parallel.py --shards 2 --device cuda:0 --devices cuda:0 cuda:1
Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import Qwen3Config

from corolla.models import get_family
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.compute.tensor_parallel import build_tensor_parallel_block, tensor_parallel_stack

SHAPE = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    rms_norm_eps=1e-6,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def sync(devices: list[torch.device]) -> None:
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


def run(
    stack: BlockStack, devices: list[torch.device], inputs: list[torch.Tensor]
) -> tuple[float, list[float], list[torch.Tensor]]:
    """Prefill inputs[0], then one cached step per later input; (prefill s, decode step times s, outputs on cpu)."""
    cache = stack.allocate_cache(1, sum(x.shape[1] for x in inputs), stack.start, stack.end)
    outputs, times, position = [], [], 0
    for x in inputs:
        sync(devices)
        begin = time.perf_counter()
        out = stack.inference_step(x, cache, position)
        sync(devices)
        times.append(time.perf_counter() - begin)
        outputs.append(out.cpu())
        position += x.shape[1]
    return times[0], times[1:], outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--shards", type=str, default="2,3", help="comma-separated shard counts to compare")
    parser.add_argument("--device", default="cpu", help="device of the unsharded stack")
    parser.add_argument("--devices", nargs="+", default=None, help="shard devices, cycled (default: --device)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of every configuration, interleaved; medians reported"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPE, num_hidden_layers=args.blocks)
    family = get_family(config)
    layout = KVLayout(*family.kv_layout(config))
    blocks = [family.block_class(config, i).eval().requires_grad_(False) for i in range(args.blocks)]
    device = torch.device(args.device)
    inputs = [torch.randn(1, args.prompt_tokens, config.hidden_size, device=device)]
    inputs += [torch.randn(1, 1, config.hidden_size, device=device) for _ in range(args.new_tokens)]

    full = BlockStack([b.to(device) for b in blocks], 0, config.hidden_size, layout, torch.float32, device)
    stacks: dict[str, tuple[BlockStack, list[torch.device]]] = {"unsharded": (full, [device])}
    for n in (int(s) for s in args.shards.split(",")):
        pool = args.devices or [args.device]
        devices = [pool[i % len(pool)] for i in range(n)]
        sharded = tensor_parallel_stack(
            [build_tensor_parallel_block(family, config, b.cpu(), devices) for b in blocks],
            0,
            config.hidden_size,
            layout,
            torch.float32,
        )
        stacks[f"{n}_shards"] = (sharded, sharded.blocks[0].devices)
    # repeats interleave the configurations, so that load from other processes hits them alike
    prefills: dict[str, list[float]] = {name: [] for name in stacks}
    decodes: dict[str, list[float]] = {name: [] for name in stacks}
    errors: dict[str, float] = {name: 0.0 for name in stacks}
    for repeat in range(args.repeats):
        reference: list[torch.Tensor] = []
        for name, (stack, devices) in stacks.items():
            print(f"repeat {repeat}: {name}", file=sys.stderr)
            prefill, steps, outputs = run(stack, devices, inputs)
            prefills[name].append(prefill)
            decodes[name].append(statistics.median(steps))
            reference = reference or outputs
            errors[name] = max([errors[name]] + [(a - b).abs().max().item() for a, b in zip(outputs, reference)])
    result: dict[str, object] = {
        "model": "qwen3-0.6b shape",
        "blocks": args.blocks,
        "threads": args.threads,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
    }
    for name, (stack, devices) in stacks.items():
        result[name] = {
            "devices": [str(d) for d in devices],
            "prefill_ms": round(statistics.median(prefills[name]) * 1e3, 2),
            "decode_ms_per_token": round(statistics.median(decodes[name]) * 1e3, 3),
            "max_abs_diff_vs_unsharded": errors[name],
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
