"""Benchmark: `corolla api` against the Python API and local HF on the same swarm.

The swarm is the 8-layer TinyLlama-shape model of bench_generate.py (vocab 32000) split over 2 servers (0:4 and
4:8, one torch thread each), with a word-level tokenizer whose token i reads "w{i}" (random weights generate any
id; every id then decodes to text, so every token is one streamed chunk). Prompts are token ids. Reported:

1. one stream: time to first token and decode tokens/s through the API (a streaming HTTP client) against the
   Python API in this process (an inference session stepped token by token with the client head) on the same
   swarm; goal: API overhead under 5% per token;
2. aggregate decode tokens/s of 1/4/16 concurrent streaming clients (all decode tokens / (last token - first
   token)), beside local HF generating the same 16 prompts as one batch with 2 torch threads; goal: >= 0.8x at 16;
3. a follow-up turn's time to first token with prefix reuse (its prompt extends the previous request's tokens)
   against a prompt of the same length that shares nothing (a fresh prefill);
4. with `--pipeline-groups 1,2`: the largest stream count again against one `corolla api` per group count, all
   on the same swarm, run in turn `--repeats` times (medians), to decide the `--pipeline-groups` default.

    python bench/bench_api.py                       # tinyllama8 (built once into the cache dir), a few minutes
    python bench/bench_api.py --model demo --streams 1,4 --new-tokens 16 --repeats 1   # smoke test, ~1-2 min
    python bench/bench_api.py --streams 16 --new-tokens 64 --pipeline-groups 1,2      # groups only

Prints one JSON object on stdout; progress goes to stderr. The API and the servers use one torch thread each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_concurrency import SERVER_ARGS, local_batched  # noqa: E402
from bench_generate import build_model  # noqa: E402

URL_LINE = re.compile(r"(http://[^\s]+/v1)")


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def prepare_model(name: str, cache_root: Path, tmp_root: Path) -> tuple[Path, int]:
    """(checkpoint directory with a tokenizer, vocab size). `demo` is the embedded model and its own tokenizer."""
    if name == "demo":
        from corolla.cli.demo_cmd import demo_model_path

        return Path(demo_model_path()), 4096
    weights = build_model(name, cache_root, tmp_root)
    path = cache_root / f"{name}-api"
    if not (path / "COMPLETE").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import AutoConfig, PreTrainedTokenizerFast

        path.mkdir(parents=True, exist_ok=True)
        for item in weights.iterdir():
            if item.name != "COMPLETE" and not (path / item.name).exists():
                (path / item.name).symlink_to(item)
        vocab = AutoConfig.from_pretrained(weights).vocab_size
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2").save_pretrained(path)
        (path / "COMPLETE").write_text("ok\n")
    from transformers import AutoConfig

    return path, AutoConfig.from_pretrained(path).vocab_size


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(3, vocab, (count, length), generator=torch.Generator().manual_seed(0)).tolist()


# ---------------------------------------------------------------------- the Python API
@torch.inference_mode()
def python_api(path: Path, peers: list[str], ids: list[int], new_tokens: int, repeats: int) -> dict:
    from corolla import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=peers)
    runs = []
    try:
        for _ in range(repeats + 1):  # the first run warms up
            begin = time.perf_counter()
            with model.inference_session(max_length=len(ids) + new_tokens) as session:
                token = model.head.logits(session.step(model.head.embed(torch.tensor([ids])))[:, -1:]).argmax(-1)
                first = time.perf_counter()
                for _ in range(new_tokens - 1):
                    token = model.head.logits(session.step(model.head.embed(token))).argmax(-1)[:, -1:]
                end = time.perf_counter()
            runs.append({"ttft_s": first - begin, "decode_tokens_per_s": (new_tokens - 1) / (end - first)})
    finally:
        model.shutdown()
    return summarize(runs[1:])


# ---------------------------------------------------------------------- the HTTP API
class ApiServer:
    """`corolla api` as a subprocess in its own process group."""

    def __init__(self, path: Path, peers: list[str], env: dict[str, str], extra: list[str]):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "corolla.cli.main", "api", str(path), "--initial-peers", *peers, "--port", "0",
             "--num-threads", "1", "--model-name", "bench", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
        self.url = ""
        found = threading.Event()

        def pump() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                match = URL_LINE.search(line)
                if match and not found.is_set():
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(300):
            self.close()
            raise RuntimeError("corolla api did not start")

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def stream_once(client: httpx.AsyncClient, url: str, ids: list[int], new_tokens: int) -> dict:
    """One streamed greedy completion: arrival times of its first and last tokens, its completion tokens."""
    body = {"model": "bench", "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    begin = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"API answered {answer.status_code}: {await answer.aread()!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    if first is None or last is None:
        raise RuntimeError("the stream carried no text")
    return {"begin": begin, "first": first, "last": last, "tokens": tokens}


def api_single(url: str, ids: list[int], new_tokens: int, repeats: int) -> dict:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=600) as client:
            out = []
            for _ in range(repeats + 1):
                r = await stream_once(client, url, ids, new_tokens)
                out.append({"ttft_s": r["first"] - r["begin"],
                            "decode_tokens_per_s": (r["tokens"] - 1) / (r["last"] - r["first"])})
            return out[1:]

    return summarize(asyncio.run(run()))


def api_concurrent(url: str, all_prompts: list[list[int]], count: int, new_tokens: int) -> dict:
    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=count + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return list(await asyncio.gather(*(stream_once(client, url, p, new_tokens) for p in all_prompts[:count])))

    streams = asyncio.run(run())
    start, end = min(s["first"] for s in streams), max(s["last"] for s in streams)
    tokens = sum(s["tokens"] - 1 for s in streams)
    return {"streams": count, "aggregate_decode_tokens_per_s": round(tokens / (end - start), 2),
            "ttft_s_median": round(statistics.median(s["first"] - s["begin"] for s in streams), 4)}


def prefix_reuse(url: str, path: Path, history_tokens: int, reply_tokens: int, new_turn: int, repeats: int,
                 vocab: int) -> dict:
    """TTFT of a follow-up turn sent as text, as chat clients send it (first turn + its reply + a new turn), which
    continues the first turn's kept session; against a prompt of the same number of tokens that shares nothing with
    any earlier request (a fresh prefill)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    rng = torch.Generator().manual_seed(1)

    def text(length: int) -> str:
        return tokenizer.decode(torch.randint(3, vocab, (length,), generator=rng).tolist(), skip_special_tokens=True)

    async def run() -> dict[str, list]:
        out: dict[str, list] = {"reused": [], "fresh": [], "cached": [], "prompt": [], "fresh_prompt": []}
        async with httpx.AsyncClient(timeout=600) as client:
            async def complete(prompt: str | list[int], max_tokens: int) -> tuple[float, dict]:
                body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                begin = time.perf_counter()
                answer = await client.post(url + "/completions", json=body)
                answer.raise_for_status()
                return time.perf_counter() - begin, answer.json()

            for r in range(repeats + 1):  # the first round warms up
                turn1 = text(history_tokens)
                _, reply = await complete(turn1, reply_tokens)
                follow_up = turn1 + reply["choices"][0]["text"] + text(new_turn)
                reused, answer = await complete(follow_up, 1)
                unrelated = torch.randint(3, vocab, (answer["usage"]["prompt_tokens"],), generator=rng).tolist()
                fresh, other = await complete(unrelated, 1)  # token ids: exactly as long
                if r:
                    out["reused"].append(reused)
                    out["fresh"].append(fresh)
                    out["cached"].append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                    out["prompt"].append(answer["usage"]["prompt_tokens"])
                    out["fresh_prompt"].append(other["usage"]["prompt_tokens"])
        return out

    out = asyncio.run(run())
    return {"history_tokens": history_tokens, "reply_tokens": reply_tokens, "new_turn_tokens": new_turn,
            "follow_up_ttft_s_with_reuse": round(statistics.median(out["reused"]), 4),
            "same_length_ttft_s_without_reuse": round(statistics.median(out["fresh"]), 4),
            "follow_up_prompt_tokens": out["prompt"], "cached_tokens": out["cached"],
            "fresh_prompt_tokens": out["fresh_prompt"],
            "runs_with": [round(x, 4) for x in out["reused"]], "runs_without": [round(x, 4) for x in out["fresh"]]}


def compare_groups(path: Path, peers: list[str], env: dict[str, str], groups: list[int], batch: list[list[int]],
                   count: int, new_tokens: int, repeats: int) -> dict:
    """Aggregate decode tokens/s of `count` streams through one `corolla api --pipeline-groups g` per g, the APIs
    taking turns `repeats` times after one warm-up each (medians)."""
    apis = {}
    try:
        for g in groups:
            apis[g] = ApiServer(path, peers, env, ["--pipeline-groups", str(g)])
            api_concurrent(apis[g].url, batch, count, min(new_tokens, 8))  # warm-up
        runs: dict[int, list[float]] = {g: [] for g in groups}
        for _ in range(repeats):
            for g in groups:
                runs[g].append(api_concurrent(apis[g].url, batch, count, new_tokens)["aggregate_decode_tokens_per_s"])
                log(f"pipeline groups {g}: {runs[g][-1]} tokens/s")
    finally:
        for api in apis.values():
            api.close()
    medians = {str(g): round(statistics.median(r), 2) for g, r in runs.items()}
    base = medians[str(groups[0])]
    return {"streams": count, "runs": {str(g): r for g, r in runs.items()}, "median_tokens_per_s": medians,
            f"ratio_vs_{groups[0]}": {g: round(m / base, 3) for g, m in medians.items()}}


def summarize(runs: list[dict]) -> dict:
    return {"ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 4),
            "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in runs), 2),
            "runs": [{k: round(v, 4) for k, v in r.items()} for r in runs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tinyllama8", help="tinyllama8 (see bench_generate.py) or demo")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--history-tokens", type=int, default=384,
                        help="tokens of the first turn in the prefix-reuse measurement")
    parser.add_argument("--cache-dir", default=None, help="where bench_generate.py keeps its checkpoints")
    parser.add_argument("--pipeline-groups", default=None,
                        help="e.g. 1,2: only compare `corolla api --pipeline-groups` values at the largest --streams")
    args = parser.parse_args()
    counts = [int(c) for c in args.streams.split(",")]
    groups = [int(g) for g in args.pipeline_groups.split(",")] if args.pipeline_groups else None

    from corolla.cli.local_swarm import LocalSwarm

    cache_root = Path(args.cache_dir or os.environ.get("COROLLA_BENCH_CACHE", "/tmp/corolla-bench"))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, vocab = prepare_model(args.model, cache_root, Path(tmp))
        batch = prompts(max(counts), args.prompt_tokens, vocab)
        log("local batched baseline")
        local = local_batched(path, torch.tensor(batch), args.new_tokens, threads=2)
        torch.set_num_threads(1)
        log(f"local: {local['decode_tokens_per_s']} tokens/s for {local['rows']} rows")
        env = {**os.environ, "COROLLA_CACHE": str(Path(tmp) / "cache")}
        with LocalSwarm(env=env) as swarm:
            peers = swarm.start_dht()
            blocks = ("0:4", "4:8") if args.model != "demo" else ("0:3", "3:6")
            servers = [swarm.start_server(str(path), ["--blocks", b, *SERVER_ARGS], wait=False) for b in blocks]
            for proc in servers:
                swarm.wait_ready(proc)
            if groups:
                report = compare_groups(path, peers, env, groups, batch, max(counts), args.new_tokens, args.repeats)
                report["local_batched"] = local
                print(json.dumps(report, indent=2))
                return 0
            log("python api, one stream")
            python = python_api(path, peers, batch[0], args.new_tokens, args.repeats)
            log(f"python api: {python}")
            api = ApiServer(path, peers, env, [])
            try:
                log("http api, one stream")
                single = api_single(api.url, batch[0], args.new_tokens, args.repeats)
                log(f"http api: {single}")
                concurrent = []
                for count in counts:
                    concurrent.append(api_concurrent(api.url, batch, count, args.new_tokens))
                    log(f"{count} streams: {concurrent[-1]}")
                reuse = prefix_reuse(api.url, path, args.history_tokens, 16, 16, args.repeats, vocab)
                log(f"prefix reuse: {reuse}")
            finally:
                api.close()
    by_count = {c["streams"]: c for c in concurrent}
    report = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "one_stream": {
            "python_api": python, "http_api": single,
            "api_overhead_per_token": round(python["decode_tokens_per_s"] / single["decode_tokens_per_s"] - 1, 4),
            "api_ttft_overhead_s": round(single["ttft_s"] - python["ttft_s"], 4),
        },
        "local_batched": local, "concurrent": concurrent,
        "ratios_vs_local_batched": {str(c): round(r["aggregate_decode_tokens_per_s"] / local["decode_tokens_per_s"], 3)
                                    for c, r in by_count.items()},
        "prefix_reuse": reuse,
    }
    report["goals"] = {"api_overhead_lt_5pct_per_token": report["one_stream"]["api_overhead_per_token"] < 0.05}
    if 16 in by_count:
        report["goals"]["16_streams_ge_0.8x_local_batched"] = report["ratios_vs_local_batched"]["16"] >= 0.8
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
