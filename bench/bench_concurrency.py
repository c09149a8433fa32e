"""Benchmark: aggregate decode throughput of 1, 4 and 16 concurrent sessions, beside local batched generation.

The swarm is the 8-layer TinyLlama-shape model (see bench_generate.py) split over 2 servers (0:4 and 4:8, one torch
thread each). Each session is a separate client process (its own DHT node and head) generating `--new-tokens`
greedy tokens after a `--prompt-tokens` prompt; all clients load first, then start together. Aggregate decode
throughput = all sessions' decode tokens / (last decode end - first decode start).

The physical limit beside it: the local HF model generating the same 16 prompts as one batch (KV cache, greedy),
with as many torch threads as the swarm has servers, decode tokens/s over the same number of steps. And the engine
alone, without any network: one server's decode step for n sessions run one by one vs as one batch.

    python bench/bench_concurrency.py --sessions 1,4,16
Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import build_model  # noqa: E402

MODEL = "tinyllama8"
SERVER_ARGS = ["--num-threads", "1", "--announce-period", "5", "--max-session-length", "1024", "--throughput", "100"]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def prompts(count: int, length: int) -> torch.Tensor:
    return torch.randint(3, 32000, (count, length), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def local_batched(path: Path, ids: torch.Tensor, new_tokens: int, threads: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runs = []
    for _ in range(2):
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        begin = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        runs.append(ids.shape[0] * (new_tokens - 1) / (time.perf_counter() - begin))
    del model
    return {"rows": ids.shape[0], "threads": threads, "decode_tokens_per_s": round(max(runs), 2), "runs": runs}


@torch.inference_mode()
def engine_batching(path: Path, counts: list[int], repeats: int = 5) -> list[dict]:
    """The server engine alone, in this process: a decode step of n sessions over half the model's blocks (one
    server's share), run one by one vs as one batch (`BlockStack.decode_batch`); one torch thread."""
    from transformers import AutoConfig

    from corolla.checkpoint import load_tensors
    from corolla.models import get_family
    from corolla.server.compute.block_stack import BlockStack, KVLayout

    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(path)
    family = get_family(config)
    half = family.num_blocks(config) // 2
    prefixes = [family.block_prefix(i) for i in range(half)]
    tensors = load_tensors(str(path), lambda name: name.startswith(tuple(prefixes)), rename=family.canonical_name)
    blocks = [family.load_block(config, index, tensors).eval() for index in range(half)]
    stack = BlockStack(
        blocks, 0, config.hidden_size, KVLayout(*family.kv_layout(config)), torch.float32, torch.device("cpu")
    )
    results = []
    for count in counts:
        caches = [stack.allocate_cache(1, 64, 0, half) for _ in range(count)]
        for cache in caches:
            stack.inference_step(torch.randn(1, 16, config.hidden_size), cache, 0)
        steps = [torch.randn(1, 1, config.hidden_size) for _ in range(count)]
        alone, batched = [], []
        for r in range(repeats):
            begin = time.perf_counter()
            for x, cache in zip(steps, caches):
                stack.inference_step(x, cache, 16 + r)
            alone.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            stack.decode_batch([(x, cache, 16 + r) for x, cache in zip(steps, caches)])
            batched.append(time.perf_counter() - begin)
        results.append(
            {
                "sessions": count,
                "blocks": half,
                "one_by_one_ms": round(statistics.median(alone) * 1e3, 1),
                "batched_ms": round(statistics.median(batched) * 1e3, 1),
            }
        )
        log(f"engine: {results[-1]}")
    del blocks, stack, tensors
    return results


def client_main(args: argparse.Namespace) -> int:
    """One session in its own process: load, signal ready, wait for go, generate, print timings as JSON."""
    torch.set_num_threads(1)
    from corolla import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(args.model_path, initial_peers=args.initial_peers)
    ids = prompts(16, args.prompt_tokens)[args.index : args.index + 1]
    sync = Path(args.sync_dir)
    (sync / f"ready-{args.index}").touch()
    while not (sync / "go").exists():
        time.sleep(0.01)
    with torch.inference_mode(), model.inference_session(max_length=args.prompt_tokens + args.new_tokens) as session:
        hidden = model.head.embed(ids)
        token = model.head.logits(session.step(hidden)[:, -1:]).argmax(-1)  # prefill
        begin = time.time()
        for _ in range(args.new_tokens - 1):
            output = session.step(model.head.embed(token))
            if not args.servers_only:  # else the same token again: the LM head's cost stays out of the measurement
                token = model.head.logits(output).argmax(-1)[:, -1:]
        end = time.time()
    print(json.dumps({"index": args.index, "decode_start": begin, "decode_end": end, "tokens": args.new_tokens - 1}))
    model.shutdown()
    return 0


def run_sessions(count: int, path: Path, peers: list[str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as sync:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--client",
                    "--index",
                    str(i),
                    "--model-path",
                    str(path),
                    "--sync-dir",
                    sync,
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                    "--new-tokens",
                    str(args.new_tokens),
                    *(["--servers-only"] if args.servers_only else []),
                    "--initial-peers",
                    *peers,
                ],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for i in range(count)
        ]
        try:
            deadline = time.monotonic() + 600
            while sum(1 for f in Path(sync).iterdir() if f.name.startswith("ready-")) < count:
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError("clients did not get ready")
                time.sleep(0.1)
            (Path(sync) / "go").touch()
            reports = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
    start, end = min(r["decode_start"] for r in reports), max(r["decode_end"] for r in reports)
    tokens = sum(r["tokens"] for r in reports)
    per_session = [r["tokens"] / (r["decode_end"] - r["decode_start"]) for r in reports]
    return {
        "sessions": count,
        "aggregate_decode_tokens_per_s": round(tokens / (end - start), 2),
        "per_session_ms_per_token_median": round(1e3 / statistics.median(per_session), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="1,4,16")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--servers-only",
        action="store_true",
        help="clients skip the LM head during decode (each feeds its last token again): measures what "
        "the servers sustain when the clients' heads run on other machines",
    )
    parser.add_argument("--max-batch-size", type=int, default=64, help="the servers' --max-batch-size")
    parser.add_argument("--cache-dir", default=None, help="where bench_generate.py keeps its checkpoints")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args)

    from corolla.cli.local_swarm import LocalSwarm

    counts = [int(c) for c in args.sessions.split(",")]
    cache_root = Path(args.cache_dir or os.environ.get("COROLLA_BENCH_CACHE", "/tmp/corolla-bench"))
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(MODEL, cache_root, Path(tmp))
        engine = engine_batching(path, counts)
        log("local batched baseline")
        local = local_batched(path, prompts(max(counts), args.prompt_tokens), args.new_tokens, threads=2)
        log(f"local: {local['decode_tokens_per_s']} tokens/s for {local['rows']} rows")
        results = []
        with LocalSwarm(env={"COROLLA_CACHE": str(Path(tmp) / "cache")}) as swarm:
            peers = swarm.start_dht()
            extra = ["--max-batch-size", str(args.max_batch_size)]
            servers = [
                swarm.start_server(str(path), ["--blocks", b, *SERVER_ARGS, *extra], wait=False) for b in ("0:4", "4:8")
            ]
            for proc in servers:
                swarm.wait_ready(proc)
            for count in counts:
                result = run_sessions(count, path, peers, args)
                log(f"{count} sessions: {result}")
                results.append(result)
    by_count = {r["sessions"]: r for r in results}
    report = {
        "model": MODEL,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "servers_only": args.servers_only,
        "max_batch_size": args.max_batch_size,
        "engine_decode_step": engine,
        "local_batched": local,
        "swarm": results,
        "ratios_vs_local_batched": {
            str(c): round(r["aggregate_decode_tokens_per_s"] / local["decode_tokens_per_s"], 3)
            for c, r in by_count.items()
        },
    }
    if 16 in by_count:
        report["goals"] = {"16_sessions_ge_0.8x_local_batched": report["ratios_vs_local_batched"]["16"] >= 0.8}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
