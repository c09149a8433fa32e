"""Benchmark: a client and 2-4 servers on emulated hosts at 0, 20, 50 and 100 ms round trip.

Every peer runs in its own network namespace with its own 10.x address (corolla.netemu; needs root), every pair of
hosts the same round trip apart. Per round trip:
- the measured link RTT (TCP echo between the client's and a server's host, median of 20);
- join time: from starting `corolla serve` (weights already on disk) to its "serving blocks" line, per server,
  and the part of it spent starting p2pd and joining the DHT;
- time to first token (opening the session + prefill of the prompt + the client's head) and decode ms/token, the
  medians over `--repeats` fresh sessions, with the round trips per token they imply (decode time / link RTT).
  Today's protocol relays every hop through the client (client -> s1 -> client -> s2 -> client), so a decode step
  costs one round trip per server: `expected_round_trips_per_token` states that baseline;
- whether greedy generation equals the local HF model's.
With `--model demo` the servers hold the bundled demo model instead, and `--speculative` then also runs
bench_speculative.py on the client's host against that swarm: plain decoding with push (and with the client relaying
every hop, `--speculative-relay`), prompt lookup and the demo draft, each sequential (one verify pass in flight) and
pipelined (`--passes-in-flight`, default auto), on a repetitive and a chat prompt, identical tokens required; it
reports decode tokens/s against plain and sequential speculation, cancelled passes, passes in flight and the
servers' wasted positions.
At the end, one server is restarted with an identity file that already exists (a server coming back after a crash):
`join_with_identity_s`.

    sudo python bench/bench_wan.py                        # 0/20/50/100 ms, 2 servers (~4 min)
    sudo python bench/bench_wan.py --rtts 0 50 --servers 3 --new-tokens 32 --repeats 5
    sudo python bench/bench_wan.py --rtts 50 --servers 3 --model demo --speculative
    sudo python bench/bench_wan.py --rtts 50 --servers 4 --model demo --modes push --speculative \
        --speculative-tokens 128 --repeats 3            # pipelined speculation's goals (~15 min)
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
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from corolla.cli.demo_cmd import demo_model_path
from corolla.netemu import Agent, EmulatedNetwork, can_emulate, start_dht, start_server
from corolla.netemu.swarm import join_time

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
SERVER_ARGS = ["--num-threads", "1", "--max-session-length", "512", "--host", "0.0.0.0"]


def log(message: str) -> None:
    print(f"[bench_wan {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_model(directory: Path, layers: int) -> str:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers})).eval().save_pretrained(directory)
    return str(directory)


def spans(layers: int, servers: int) -> list[str]:
    bounds = [round(i * layers / servers) for i in range(servers + 1)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])]


def run_rtt(model: str, rtt_ms: float, args: argparse.Namespace, reference: list[list[int]], ids: torch.Tensor,
            identities: Path, log_file) -> dict:
    hosts = ["dht", *[f"s{i}" for i in range(args.servers)], "client"]
    with EmulatedNetwork(hosts, rtt=rtt_ms / 1e3, rate_mbit=args.rate_mbit) as net:
        measured = net.measure_rtt("client", "s0", samples=20)
        _, peers = start_dht(net, "dht", "--host", "0.0.0.0", log=log_file)
        procs = [start_server(net, f"s{i}", model, peers, *SERVER_ARGS, "--blocks", span, "--identity",
                              str(identities / f"s{i}.key"), label=f"s{i}", log=log_file, wait=False)
                 for i, span in enumerate(spans(args.layers, args.servers))]
        join = [join_time(proc) for proc in procs]
        dht_join = [float(proc.wait_for(r"joined the swarm as \S+ in ([\d.]+)s", 10).group(1)) for proc in procs]
        log(f"rtt {rtt_ms} ms: measured {measured * 1e3:.2f} ms, servers joined after {[round(j, 2) for j in join]} s")
        result = {
            "rtt_configured_ms": rtt_ms,
            "rtt_measured_ms": round(measured * 1e3, 3),
            "join_time_s": [round(j, 3) for j in join],
            "join_p2p_and_dht_s": dht_join,  # of which: starting p2pd and joining the DHT (from the server's log)
        }
        for mode in args.modes:  # push: server to server; relay: the client relays every hop (Petals' structure)
            client = Agent(
                net, "client", model, peers, config={"push": mode == "push"}, label=f"client-{mode}", log=log_file
            )
            if not client.ready["ready"]:
                raise RuntimeError(f"client did not start: {client.ready}")
            matches = client.generate(ids, args.new_tokens) == reference
            timed = client.request(
                "timed_decode", ids=ids.tolist(), new_tokens=args.new_tokens, repeats=args.repeats, timeout=600
            )
            exchanges = timed.get("exchanges_per_token")
            client.proc.stop()
            if not timed["ok"]:
                raise RuntimeError(f"timed decode failed: {timed['error']}")
            ttft = statistics.median(timed["ttft_s"])
            decode = statistics.median(timed["decode_s_per_token"])
            result[mode] = {
                "ttft_ms": round(ttft * 1e3, 2),
                "decode_ms_per_token": round(decode * 1e3, 2),
                "tokens_per_s": round(1 / decode, 2),
                # decode time over the measured link RTT: the round trips a token really waits for
                "round_trips_per_token": round(decode / measured, 2) if rtt_ms > 0 else None,
                "round_trips_to_first_token": round(ttft / measured, 2) if rtt_ms > 0 else None,
                "expected_round_trips_per_token": 1 + (args.servers - 1) / 2 if mode == "push" else args.servers,
                # counted by the session: requests the client sent and waited for, per decoded token
                "client_requests_per_token": exchanges,
                "greedy_matches_hf": matches,
            }
        if {"push", "relay"} <= set(args.modes):
            result["push_speedup"] = round(
                result["relay"]["decode_ms_per_token"] / result["push"]["decode_ms_per_token"], 3
            )
        if args.speculative:
            result["speculative"] = run_speculative(net, model, peers, args)
        if (
            rtt_ms == args.rtts[-1] and args.restart
        ):  # a server coming back: restart s0 with its (now existing) identity
            procs[0].stop()
            again = start_server(
                net,
                "s0",
                model,
                peers,
                *SERVER_ARGS,
                "--blocks",
                spans(args.layers, args.servers)[0],
                "--identity",
                str(identities / "s0.key"),
                label="s0-restarted",
                log=log_file,
                wait=False,
            )
            result["join_with_identity_s"] = round(join_time(again), 3)
            result["join_with_identity_p2p_and_dht_s"] = float(
                again.wait_for(r"joined the swarm as \S+ in ([\d.]+)s", 10).group(1)
            )
            # the import of torch/transformers/hivemind alone, for scale (the machine's load shows in both)
            begin = time.monotonic()
            net.run("s0", [sys.executable, "-c", "import corolla.server.server"], timeout=300)
            result["python_imports_s"] = round(time.monotonic() - begin, 3)
        log(f"rtt {rtt_ms} ms: {json.dumps(result)}")
        return result


def run_speculative(net, model: str, peers: list[str], args: argparse.Namespace) -> dict:
    """bench_speculative.py on the client's host against this swarm (plain push/relay, prompt lookup, demo draft)."""
    argv = [
        sys.executable,
        str(Path(__file__).with_name("bench_speculative.py")),
        "--initial-peers",
        *peers,
        "--model",
        model,
        *(["--relay-baseline"] if args.speculative_relay else []),
        "--passes-in-flight",
        str(args.passes_in_flight),
        "--prompts",
        "repetitive",
        "chat",
        "--new-tokens",
        str(args.speculative_tokens),
        "--repeats",
        str(args.repeats),
    ]
    done = net.run("client", argv, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench_speculative failed: {done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    log(f"speculative: {json.dumps(report['summary'])}")
    return {"runs": report["runs"], "summary": report["summary"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", type=float, nargs="+", default=[0, 20, 50, 100], help="round trips to test, ms")
    parser.add_argument("--servers", type=int, default=2, choices=(2, 3, 4), help="servers, each on its own host")
    parser.add_argument("--layers", type=int, default=6, help="blocks of the tiny random Llama")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per timed generation")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="timed sessions per round trip (median reported)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="cap each host's link at this rate (Mbit/s)")
    parser.add_argument("--restart", action="store_true", help="also time a server restarting with its identity")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["push", "relay"],
        choices=("push", "relay"),
        help="push: servers send each step's output straight to the next server; relay: the client relays every hop",
    )
    parser.add_argument("--log", default=None, help="write every process's output to this file")
    parser.add_argument(
        "--model",
        choices=("tiny", "demo"),
        default="tiny",
        help="tiny: a random-weight Llama of --layers blocks; demo: the bundled demo model (6 blocks)",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="also speculative decoding vs relay (bench_speculative.py; needs --model demo)",
    )
    parser.add_argument("--speculative-tokens", type=int, default=64, help="new tokens per speculative run")
    parser.add_argument("--speculative-relay", action="store_true", help="speculative runs: also plain with relay")
    parser.add_argument("--passes-in-flight", default="auto", help="the pipelined speculative modes' setting")
    args = parser.parse_args()
    if args.speculative and args.model != "demo":
        parser.error("--speculative needs --model demo (the draft model is the demo model's)")
    usable, why = can_emulate()
    if not usable:
        print(json.dumps({"error": f"emulated hosts unavailable: {why}"}))
        return 2
    with (
        tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp,
        open(args.log or Path(tmp) / "processes.log", "w") as log_file,
    ):
        if args.model == "demo":
            model, args.layers = str(demo_model_path()), 6
        else:
            model = build_model(Path(tmp) / "tiny-llama", args.layers)
        torch.manual_seed(1)
        vocab = AutoConfig.from_pretrained(model).vocab_size
        ids = torch.randint(3, vocab, (1, args.prompt_tokens))
        hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            reference = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0).tolist()
        del hf
        identities = Path(tmp) / "identities"
        identities.mkdir()
        results = [run_rtt(model, rtt, args, reference, ids, identities, log_file) for rtt in args.rtts]
    print(
        json.dumps(
            {
                "servers": args.servers,
                "model": args.model,
                "layers": args.layers,
                "new_tokens": args.new_tokens,
                "prompt_tokens": args.prompt_tokens,
                "repeats": args.repeats,
                "rate_mbit": args.rate_mbit,
                "protocol": "push: client -> s0 -> s1 -> ... -> client (one crossing per hop plus one back); "
                "relay: the client relays every hop (one round trip per server)",
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
