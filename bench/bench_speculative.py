"""Benchmark: speculative decoding against plain decoding through a swarm, greedy, identical tokens required.

Modes, each on the same prompts and the same swarm:

* plain           - one token per round trip (a session step through the servers' chain);
* prompt_lookup   - `prompt_lookup_num_tokens=K`: drafts copied from the context (no model);
* draft           - `assistant_model=` the demo model's shipped draft (corolla/demo_draft), its generation_config's
                    num_assistant_tokens;
* plain_relay     - (with --relay-baseline) plain decoding with `ClientConfig(push=False)`: the client relays every
                    hop, Petals' structure; the summary's `decode_speedup_vs_relay` compares every mode with it;
* plain_sampling, draft_sampling - (with --sampling) T=0.8, top_p=0.9 without and with the draft: their tokens
                    differ by design (the target distribution is kept, not the draws), so only round trips and speed
                    are compared.

Measured per run (a fresh inference session each): round trips = the session's `steps` (steps sent through the
chain), tokens per round trip = new tokens / round trips, client requests per token = the session's `exchanges`
(requests the client sent and waited for: one per step in push mode, one per server in relay mode) / new tokens, time
to first token, and decode tokens/s =
(new tokens - 1) / (time of the last token - time of the first), from a streamer's timestamps, and the time per
round trip spent in the swarm (inside session steps) and in the client (drafting, heads, sampling). Medians over repeats
after one untimed warm-up. Greedy modes must give plain's tokens exactly (`identical_tokens`).

Without --initial-peers it starts a loopback swarm (a DHT peer and two servers, blocks 0:3 and 3:6 of the demo model,
one torch thread each); with them it measures that swarm (e.g. emulated WAN hosts): `compare()` is the entry point
for other benchmarks. `projected_speedup_at_50ms_rtt_2_crossings` is arithmetic, not a measurement: the speedup if
every round trip also crossed a 50 ms link twice (client relay over 2 servers), from the measured times per round
trip; the WAN benchmark measures it. Prints one JSON object on stdout, progress on stderr.

    python bench/bench_speculative.py                      # loopback, ~2-4 min here
    python bench/bench_speculative.py --new-tokens 64 --repeats 1 --sampling
    python bench/bench_speculative.py --initial-peers /ip4/10.77.0.1/tcp/31337/p2p/12D3...
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corolla import AutoDistributedModelForCausalLM
from corolla.checkpoint import load_config
from corolla.client.config import ClientConfig
from corolla.cli.demo_cmd import demo_draft_path, demo_model_path
from corolla.cli.local_swarm import LocalSwarm
from corolla.models import get_family

# A text that repeats itself, as summaries, edits and code reviews of a context do: prompt lookup's case.
REPETITIVE = (
    "The file system keeps a list of the blocks of each file. The file system keeps a list of the free "
    "blocks. When a file grows, the file system takes a block from the list of the free blocks and adds it "
    "to the list of the blocks of the file. When a file shrinks, the file system"
)
PROMPTS = {"repetitive": REPETITIVE, "chat": "Human: What is a file system?\nAssistant:", "open": "The server"}
LOOKUP_TOKENS = 6


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class Clock:
    """A streamer that timestamps each put of new tokens (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_once(model, ids: torch.Tensor, new_tokens: int, kwargs: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """One generate call in a fresh session: its tokens, round trips and timings."""
    clock = Clock()
    if seed is not None:
        torch.manual_seed(seed)
    with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
        in_swarm = _time_steps(session)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, streamer=clock, eos_token_id=None, **kwargs)
        total = time.perf_counter() - start
        steps, exchanges = session.steps, session.exchanges
        cancelled, cancelled_positions = session.cancelled_steps, session.cancelled_positions
        servers = len(session.route)
        submitted_mean = session.in_flight_total / max(steps, 1)
    new = out.shape[1] - ids.shape[1]
    decode = clock.times[-1] - clock.times[0] if len(clock.times) > 1 else float("nan")
    return {
        "tokens": out[0, ids.shape[1] :].tolist(),
        "new_tokens": new,
        "round_trips": steps,  # passes sent (pipelined: cancelled ones included)
        "tokens_per_round_trip": new / steps,
        "cancelled_passes": cancelled,
        "passes_in_flight_mean": submitted_mean,  # passes in flight once a pass was sent, it included
        # positions the servers computed for cancelled passes, summed over the route's servers
        "wasted_server_positions": cancelled_positions * servers,
        "client_requests_per_token": exchanges / new,
        "time_to_first_token_s": clock.times[0] - start,
        "total_s": total,
        "swarm_ms_per_round_trip": 1e3 * sum(in_swarm) / steps,
        "client_ms_per_round_trip": 1e3 * (total - sum(in_swarm)) / steps,
        "decode_tokens_per_s": (new - 1) / decode if new > 1 else float("nan"),
    }


def _time_steps(session) -> list[float]:
    """The seconds each step of `session` spends in the swarm (wraps this session's step_async; bench only)."""
    spent: list[float] = []
    step_async = session.step_async

    async def timed(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return await step_async(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - begin)

    session.step_async = timed
    return spent


def projected_tokens_per_s(result: dict[str, Any], added_rtt_ms: float, crossings: int) -> float:
    """A projection, not a measurement: decode tokens/s if each round trip also paid `crossings` network round trips
    of `added_rtt_ms` (client relay over S servers: S crossings; push: about 1), the client's and servers' work as
    measured here."""
    per_round_trip = result["client_ms_per_round_trip"] + result["swarm_ms_per_round_trip"] + crossings * added_rtt_ms
    return 1e3 * result["tokens_per_round_trip"] / per_round_trip


def compare(
    initial_peers: Sequence[str],
    model_path: str | None = None,
    draft_path: str | None = None,
    *,
    prompts: dict[str, str] | None = None,
    new_tokens: int = 128,
    repeats: int = 3,
    sampling: bool = False,
    lookup_tokens: int = LOOKUP_TOKENS,
    relay_baseline: bool = False,
    passes_in_flight: int | str = "auto",
) -> dict[str, Any]:
    """Plain vs speculative decoding through the swarm at `initial_peers` (the demo model and its draft unless given).

    Returns {"runs": {mode: {prompt: medians...}}, "summary": {mode: ...}}; greedy modes record whether their tokens
    equal plain decoding's on every prompt (`identical_tokens`)."""
    model_path = model_path or str(demo_model_path())
    draft_path = draft_path or str(demo_draft_path())
    prompts = prompts or PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=list(initial_peers), torch_dtype=torch.float32
    )
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    clients = {"push": model}
    sequential = {"passes_in_flight": 1}
    pipelined = {"passes_in_flight": passes_in_flight}
    modes: dict[str, tuple[dict[str, Any], int | None]] = {
        "plain": ({}, None),
        "prompt_lookup": ({"prompt_lookup_num_tokens": lookup_tokens, **sequential}, None),
        "prompt_lookup_pipelined": ({"prompt_lookup_num_tokens": lookup_tokens, **pipelined}, None),
        "draft": ({"assistant_model": draft, **sequential}, None),
        "draft_pipelined": ({"assistant_model": draft, **pipelined}, None),
    }
    if sampling:
        settings = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0}
        modes["plain_sampling"] = (settings, 0)
        modes["draft_sampling"] = ({"assistant_model": draft, **settings, **sequential}, 0)
        modes["draft_sampling_pipelined"] = ({"assistant_model": draft, **settings, **pipelined}, 0)
    if relay_baseline:  # a second client on the same swarm that relays every hop
        clients["relay"] = AutoDistributedModelForCausalLM.from_pretrained(
            model_path,
            initial_peers=list(initial_peers),
            torch_dtype=torch.float32,
            client_config=ClientConfig(push=False),
        )
        modes["plain_relay"] = ({}, None)
    runs: dict[str, dict[str, Any]] = {mode: {} for mode in modes}
    try:
        for name, text in prompts.items():
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            for mode, (kwargs, seed) in modes.items():
                client = clients["relay" if mode == "plain_relay" else "push"]
                run_once(client, ids, new_tokens, kwargs, seed)  # warm-up
                results = [run_once(client, ids, new_tokens, kwargs, seed) for _ in range(repeats)]
                if any(r["tokens"] != results[0]["tokens"] for r in results):
                    raise RuntimeError(f"{mode} on {name}: tokens changed between runs")
                runs[mode][name] = _medians(results)
                log(
                    f"{name:10s} {mode:14s} {runs[mode][name]['tokens_per_round_trip']:.2f} tokens/round trip, "
                    f"{runs[mode][name]['decode_tokens_per_s']:.1f} tokens/s"
                )
    finally:
        for client in clients.values():
            client.shutdown()
    return {"runs": _without_tokens(runs), "summary": _summary(runs, modes)}


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "round_trips",
        "tokens_per_round_trip",
        "client_requests_per_token",
        "time_to_first_token_s",
        "total_s",
        "decode_tokens_per_s",
        "swarm_ms_per_round_trip",
        "client_ms_per_round_trip",
        "cancelled_passes",
        "passes_in_flight_mean",
        "wasted_server_positions",
    )
    out = {key: round(statistics.median(r[key] for r in results), 4) for key in keys}
    return {**out, "new_tokens": results[0]["new_tokens"], "tokens": results[0]["tokens"]}


def _summary(runs: dict[str, dict[str, Any]], modes: dict[str, Any]) -> dict[str, Any]:
    summary = {}
    for mode in modes:
        plain = runs["plain_sampling" if modes[mode][1] is not None else "plain"]  # sampling against plain sampling
        per_prompt = {}
        for name, result in runs[mode].items():
            entry = {
                "tokens_per_round_trip": result["tokens_per_round_trip"],
                "decode_speedup_vs_plain": round(result["decode_tokens_per_s"] / plain[name]["decode_tokens_per_s"], 3),
                "round_trip_ratio_vs_plain": round(plain[name]["round_trips"] / result["round_trips"], 3),
                "projected_speedup_at_50ms_rtt_2_crossings": round(
                    projected_tokens_per_s(result, 50, 2) / projected_tokens_per_s(plain[name], 50, 2), 2
                ),
            }
            if "plain_relay" in runs and modes[mode][1] is None:
                relay = runs["plain_relay"][name]
                entry["decode_speedup_vs_relay"] = round(
                    result["decode_tokens_per_s"] / relay["decode_tokens_per_s"], 3
                )
                entry["ttft_vs_relay"] = round(result["time_to_first_token_s"] / relay["time_to_first_token_s"], 3)
            if modes[mode][1] is None:  # greedy: must be plain's tokens
                entry["identical_tokens"] = result["tokens"] == plain[name]["tokens"]
            sequential = mode.removesuffix("_pipelined")
            if sequential != mode and sequential in runs:
                entry["decode_speedup_vs_sequential"] = round(
                    result["decode_tokens_per_s"] / runs[sequential][name]["decode_tokens_per_s"], 3
                )
                for key in ("cancelled_passes", "passes_in_flight_mean", "wasted_server_positions"):
                    entry[key] = result[key]
            per_prompt[name] = entry
        summary[mode] = per_prompt
    return summary


def _without_tokens(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        mode: {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in per.items()}
        for mode, per in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=None, help="measure this swarm instead of a loopback one")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded demo model)")
    parser.add_argument("--draft", default=None, help="assistant checkpoint (default: the shipped demo draft)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookup-tokens", type=int, default=LOOKUP_TOKENS, help="prompt_lookup_num_tokens")
    parser.add_argument("--sampling", action="store_true", help="also the draft with sampling (T=0.8, top_p=0.9)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the client (servers: 1 each)")
    parser.add_argument(
        "--relay-baseline",
        action="store_true",
        help="also plain decoding with the client relaying every hop (push=False)",
    )
    parser.add_argument("--prompts", nargs="+", choices=tuple(PROMPTS), default=None, help="a subset of the prompts")
    parser.add_argument("--passes-in-flight", default="auto", help="the pipelined modes' passes_in_flight (auto or N)")
    args = parser.parse_args()
    depth = args.passes_in_flight if args.passes_in_flight == "auto" else int(args.passes_in_flight)
    torch.set_num_threads(args.threads)
    model_path = args.model or str(demo_model_path())
    options = dict(
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        sampling=args.sampling,
        lookup_tokens=args.lookup_tokens,
        relay_baseline=args.relay_baseline,
        passes_in_flight=depth,
        prompts={name: PROMPTS[name] for name in args.prompts} if args.prompts else None,
    )
    report: dict[str, Any] = {
        "benchmark": "bench_speculative",
        "model": model_path,
        "draft": args.draft or str(demo_draft_path()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "client_threads": args.threads,
        **options,
    }
    if args.initial_peers:
        report["swarm"] = {"initial_peers": args.initial_peers}
        report.update(compare(args.initial_peers, model_path, args.draft, **options))
    else:
        config = load_config(model_path)
        half = get_family(config).num_blocks(config) // 2
        spans = [f"0:{half}", f"{half}:{2 * half + get_family(config).num_blocks(config) % 2}"]
        with LocalSwarm() as swarm:
            peers = swarm.start_dht()
            servers = [
                swarm.start_server(model_path, ["--blocks", b, "--num-threads", "1"], name=f"server-{b}", wait=False)
                for b in spans
            ]
            for proc in servers:
                swarm.wait_ready(proc)
            report["swarm"] = {"kind": "loopback", "servers": spans, "server_threads": 1}
            report.update(compare(peers, model_path, args.draft, **options))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
