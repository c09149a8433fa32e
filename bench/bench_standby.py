"""Benchmark: kill-to-next-token at long context, with a standby replica (standby=1) and without (full replay).

Emulated hosts (corolla.netemu; needs root): a client, a DHT peer and four servers, every host 50 ms apart with
20 Mbit/s links (both directions). A random Llama (hidden 1024, 6 blocks, float32) is served as 0:2 | 2:4 | 2:4 | 4:6:
the middle span has two servers, the one announcing the higher throughput being the session's primary. Each trial
opens a session (with or without a standby), prefills a random prompt of `--contexts` tokens, decodes greedily, and
after `--kill-after` tokens SIGKILLs the server of the middle span. Reported per trial: the time from the kill to
the next token, the median normal decode step before it, the prefill time (to the first token), with a standby
the time it took to catch up after the prefill (its copy of the prompt goes over the client's uplink too), the
session's counters, and whether the greedy tokens equal the local HF model's. The killed server is restarted
between trials.

    sudo python bench/bench_standby.py                             # 512 and 2,048 tokens, 1 repeat (~10 min)
    sudo python bench/bench_standby.py --contexts 2048 --repeats 2
Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

MODEL = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=8448, bos_token_id=1, eos_token_id=2)
SPANS = {"a": ("0:2", "100"), "b": ("2:4", "1000"), "c": ("2:4", "10"), "d": ("4:6", "100")}  # host: blocks, tput
SERVER_ARGS = ["--num-threads", "1", "--max-session-length", "8448", "--host", "0.0.0.0", "--announce-period", "2"]


def log(message: str) -> None:
    print(f"[bench_standby {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the client, on its emulated host
def client_main(model: str, peers: list[str]) -> int:
    """Read trials (JSON lines) on stdin; for each, print {"kill": PEER} when it wants the middle span's server
    killed (and wait for a line back), then {"ok": ...} with its measurements."""
    import asyncio
    import logging

    from corolla import AutoDistributedModelForCausalLM, ClientConfig

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("corolla.client").setLevel(  # failover events, timed, in the process log
        logging.DEBUG if os.environ.get("BENCH_DEBUG") else logging.INFO)
    from corolla.client.event_loop import run_sync

    client = AutoDistributedModelForCausalLM.from_pretrained(
        model, initial_peers=peers, client_config=ClientConfig(initial_peers=tuple(peers), update_period=2.0))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        trial = json.loads(line)
        ids = torch.tensor([trial["ids"]])
        with client.inference_session(max_length=ids.shape[1] + trial["new_tokens"], standby=trial["standby"]) as s:
            entered, left, marks = [], [], {}  # when each put() began and returned (perf_counter)

            class Streamer:
                def put(self, value) -> None:
                    n = len(entered)
                    entered.append(time.perf_counter())
                    if n == 1 and trial["standby"]:  # the first token: let the standby catch up with the prompt
                        async def idle() -> None:
                            for standby in list(s.chain.standbys.by_primary.values()):
                                await asyncio.wait_for(standby.idle.wait(), 600)

                        run_sync(idle())
                        marks["catch_up_s"] = time.perf_counter() - entered[1]
                    if n == trial["kill_after"]:
                        victim = next(x.peer_id for x in s.route if (x.start, x.end) == (2, 4))
                        print(json.dumps({"kill": victim}), flush=True)
                        sys.stdin.readline()
                        marks["killed_at"] = time.perf_counter()
                        logging.getLogger("bench_standby").warning("killed %s", victim)  # the failover's log, timed
                    left.append(time.perf_counter())

                def end(self) -> None:
                    pass

            begin = time.perf_counter()
            out = client.generate(ids, max_new_tokens=trial["new_tokens"], streamer=Streamer())
            k = trial["kill_after"]
            steps = [entered[n] - left[n - 1] for n in range(2, k + 1)]  # decode steps before the kill
            result = {
                "ok": True, "tokens": out[0].tolist(),
                "ttft_s": entered[1] - begin,
                "catch_up_s": marks.get("catch_up_s"),
                "normal_step_s": statistics.median(steps),
                "kill_to_next_token_s": entered[k + 1] - marks["killed_at"],
                "route_after": [x.peer_id for x in s.route],
                **{name: getattr(s, name) for name in (
                    "exchanges", "standby_steps", "standby_bytes_sent", "standby_replayed_positions",
                    "standby_promotions", "standby_missing", "standby_lost", "standby_mismatches")},
            }
        print(json.dumps(result), flush=True)
    client.shutdown()
    return 0


# ---------------------------------------------------------------------- the orchestrator
def run(args: argparse.Namespace) -> dict:
    from corolla.netemu import EmulatedNetwork, can_emulate, start_dht, start_server, wait_serving

    usable, why = can_emulate()
    if not usable:
        return {"error": f"emulated hosts unavailable: {why}"}
    tmp = Path(tempfile.mkdtemp(prefix="bench-standby-"))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**MODEL)).eval()
    hf.save_pretrained(tmp / "model")
    model = str(tmp / "model")
    trials = []
    log(f"process logs: {tmp / 'processes.log'}")
    with open(tmp / "processes.log", "w") as log_file, \
            EmulatedNetwork(["dht", *SPANS, "client"], rtt=args.rtt_ms / 1e3, rate_mbit=args.rate_mbit) as net:
        _, peers = start_dht(net, "dht", "--host", "0.0.0.0", log=log_file)

        def serve(host: str):
            blocks, tput = SPANS[host]
            proc = start_server(net, host, model, peers, *SERVER_ARGS, "--blocks", blocks, "--throughput", tput,
                                label=host, log=log_file, wait=False)
            return proc

        procs = {host: serve(host) for host in SPANS}
        peer_of = {host: wait_serving(proc) for host, proc in procs.items()}
        log(f"servers up: {peer_of}")
        client = net.spawn("client", [sys.executable, __file__, "--client", model, "--initial-peers", *peers],
                           label="client", log_file=log_file, stdin=True)
        client.wait_for(r'^\{"ready"', 300)
        for context in args.contexts:
            ids = torch.randint(3, MODEL["vocab_size"], (1, context), generator=torch.Generator().manual_seed(context))
            with torch.no_grad():
                expected = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)[0]
            for repeat in range(args.repeats):
                for standby in args.standby:
                    log(f"context {context}, standby={standby}, repeat {repeat}")
                    start = client.lines_printed
                    client.send(json.dumps({"ids": ids[0].tolist(), "new_tokens": args.new_tokens,
                                            "kill_after": args.kill_after, "standby": standby}))
                    victim = json.loads(client.wait_for(r'^(\{"kill".*)$', 900, start=start).group(1))["kill"]
                    host = next(h for h, p in peer_of.items() if p == victim)
                    procs[host].signal(signal.SIGKILL)
                    client.send("killed")
                    result = json.loads(client.wait_for(r'^(\{"ok".*)$', 900, start=start).group(1))
                    result.update(context=context, standby=standby, killed=host,
                                  greedy_equals_hf=result.pop("tokens") == expected.tolist())
                    log(json.dumps(result))
                    trials.append(result)
                    procs[host].stop()
                    procs[host] = serve(host)
                    peer_of[host] = wait_serving(procs[host])
                    time.sleep(3)  # the client's view (update_period 2 s) sees the restarted server
        client.stop()
    return {"trials": trials, "summary": summarize(trials)}


def summarize(trials: list[dict]) -> list[dict]:
    rows = []
    for context in sorted({t["context"] for t in trials}):
        row: dict = {"context": context}
        for standby in (1, 0):
            mine = [t for t in trials if t["context"] == context and t["standby"] == standby]
            if not mine:
                continue
            key = "standby" if standby else "replay"
            kill = statistics.median(t["kill_to_next_token_s"] for t in mine)
            step = statistics.median(t["normal_step_s"] for t in mine)
            row[key] = {"kill_to_next_token_s": round(kill, 3), "normal_step_s": round(step, 3),
                        "x_normal_step": round(kill / step, 2),
                        "ttft_s": round(statistics.median(t["ttft_s"] for t in mine), 3),
                        "greedy_equals_hf": all(t["greedy_equals_hf"] for t in mine)}
            if standby:
                row[key]["catch_up_s"] = round(statistics.median(t["catch_up_s"] for t in mine), 3)
                row[key]["standby_bytes_sent"] = mine[0]["standby_bytes_sent"]
                row[key]["promotions"] = sum(t["standby_promotions"] for t in mine)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=1, help="trials per context and mode")
    parser.add_argument("--standby", type=int, nargs="+", default=[1, 0], choices=[0, 1],
                        help="modes to run: 1 = a standby promoted, 0 = the history replayed")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per trial")
    parser.add_argument("--kill-after", type=int, default=5, help="the kill comes right after this many tokens")
    parser.add_argument("--rtt-ms", type=float, default=50.0, help="round trip between any two hosts, ms")
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="every host's link rate, Mbit/s")
    parser.add_argument("--client", nargs=1, metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args.client[0], args.initial_peers)
    if not 2 <= args.kill_after < args.new_tokens:
        parser.error("--kill-after must be within [2, --new-tokens)")
    report = run(args)
    print(json.dumps({"rtt_ms": args.rtt_ms, "rate_mbit": args.rate_mbit, "model": MODEL,
                      "spans": {h: b for h, (b, _) in SPANS.items()}, "new_tokens": args.new_tokens,
                      "kill_after": args.kill_after, **report}, indent=2))
    return 0 if "error" not in report else 2


if __name__ == "__main__":
    sys.exit(main())
