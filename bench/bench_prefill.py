"""Benchmark: time to first token of a long prompt over slow links, one-shot vs pipelined prefill, per codec.

A client and 3 servers, each on its own emulated host (corolla.netemu; needs root), every pair `--rtt` ms apart and
every host's link capped at `--rate-mbit` (home uplinks); a random Llama with hidden `--hidden` and `--layers` blocks
split over the servers; a `--prompt-tokens` prompt. Per mode, the median over `--repeats` fresh sessions of the time
to first token (opening the session, the prefill, the client's head):

- `oneshot-none`: the whole prompt in one push step, exact activations, every position's output back to the client
  (corolla before pipelined prefill);
- `pipelined-<codec>`: the prompt in chunks (ClientConfig.prefill_chunk_tokens, auto by default) with hidden states in
  that codec on every hop, and only the last position's output back to the client, as `generate` asks.

It also reports each mode's speed-up over `oneshot-none`, and how far its last hidden state is from the exact one
(relative L2) and whether its greedy first token is the same.

    sudo python bench/bench_prefill.py                              # 50 ms, 20 Mbit/s, hidden 2048, 2048 tokens
    sudo python bench/bench_prefill.py --modes oneshot-none pipelined-int8 --repeats 3
Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from corolla.netemu import Agent, EmulatedNetwork, can_emulate, start_dht, start_server

MODES = ("oneshot-none", "pipelined-none", "pipelined-bf16", "pipelined-int8", "pipelined-4bit")
SERVER_ARGS = ["--num-threads", "1", "--host", "0.0.0.0"]


def log(message: str) -> None:
    print(f"[bench_prefill {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_model(directory: Path, hidden: int, layers: int, intermediate: int) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return str(directory)


def spans(layers: int, servers: int) -> list[str]:
    bounds = [round(i * layers / servers) for i in range(servers + 1)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])]


def config_of(mode: str, prompt_tokens: int, chunk: int | None) -> dict:
    kind, codec = mode.split("-")
    config: dict = {"compression": codec, "request_timeout": 600.0}
    config["prefill_chunk_tokens"] = prompt_tokens if kind == "oneshot" else chunk
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt", type=float, default=50.0, help="round trip between every pair of hosts, ms")
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="each host's link, Mbit/s")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP width (small: the links are the subject)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="pipelined chunk size (default: auto)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--log", default=None, help="write every process's output to this file")
    args = parser.parse_args()
    if not can_emulate():
        print("needs root (network namespaces): run with sudo", file=sys.stderr)
        return 2
    log_file = open(args.log, "w") if args.log else None
    torch.manual_seed(1)
    ids = torch.randint(3, 1024, (1, args.prompt_tokens))
    ids[0, 0] = 1
    results: dict = {"rtt_ms": args.rtt, "rate_mbit": args.rate_mbit, "servers": args.servers, "hidden": args.hidden,
                     "layers": args.layers, "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "llama", args.hidden, args.layers, args.intermediate)
        hosts = ["dht", *[f"s{i}" for i in range(args.servers)], "client"]
        with EmulatedNetwork(hosts, rtt=args.rtt / 1e3, rate_mbit=args.rate_mbit) as net:
            _, peers = start_dht(net, "dht", "--host", "0.0.0.0", log=log_file)
            procs = [start_server(net, f"s{i}", model, peers, *SERVER_ARGS, "--blocks", span,
                                  "--max-session-length", str(args.prompt_tokens + 8), label=f"s{i}", log=log_file,
                                  wait=False) for i, span in enumerate(spans(args.layers, args.servers))]
            for proc in procs:
                proc.wait_for(r"serving blocks", 600)
            exact = None
            for mode in args.modes:
                client = Agent(
                    net,
                    "client",
                    model,
                    peers,
                    config=config_of(mode, args.prompt_tokens, args.chunk_tokens),
                    label=f"client-{mode}",
                    log=log_file,
                )
                if not client.ready["ready"]:
                    raise RuntimeError(f"client did not start: {client.ready}")
                answer_last = None if mode.startswith("oneshot") else 1
                reply = client.request("timed_prefill", ids=ids.tolist(), repeats=args.repeats, last=answer_last,
                                       timeout=3600)
                client.proc.stop()
                if not reply["ok"]:
                    raise RuntimeError(f"{mode} failed: {reply['error']}\n{reply.get('trace', '')}")
                last = torch.tensor(reply["last_hidden"])
                if mode == "oneshot-none":
                    exact = (last, reply["token"])
                entry = {
                    "ttft_s": round(statistics.median(reply["ttft_s"]), 3),
                    "ttft_runs_s": [round(t, 3) for t in reply["ttft_s"]],
                    "pushed_steps": reply["pushed_steps"],
                }
                if exact is not None:
                    entry["relative_error_vs_exact"] = float((last - exact[0]).norm() / exact[0].norm())
                    entry["same_first_token"] = reply["token"] == exact[1]
                results["modes"][mode] = entry
                log(f"{mode}: {json.dumps(entry)}")
    base = results["modes"].get("oneshot-none", {}).get("ttft_s")
    if base:
        for entry in results["modes"].values():
            entry["speedup_vs_oneshot_none"] = round(base / entry["ttft_s"], 2)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
