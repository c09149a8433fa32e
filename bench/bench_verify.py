"""Benchmark: what spot checks (ClientConfig.verify_rate) cost and how fast they catch a `corrupt` server.

A local swarm (loopback) of a random-weight Llama (hidden 256, 4 blocks) with every span replicated: servers
`head` and `head2` hold 0:2, `tail` and `tail2` hold 2:4, and `bad` holds 2:4 with `--inject-fault corrupt`.

1. Speed: `bad` is not armed; sessions route head -> tail (the fastest servers), the others check them. For each
verify_rate
   in 0, 0.05, 0.1, 0.25 (interleaved, --runs times each, a fresh client per run), a session generates
   --new-tokens greedy tokens after a 16-token prompt; tokens/s = new tokens / wall time of `generate` (checks
   waited for at the end included). Medians and the slowdown against rate 0. Every check in these runs is between
   honest servers, so their failed checks are the false positives. The machine may be shared: each round runs every
   rate once (in rotating order), `slowdown_paired_median` compares each run with its own round's rate-0 run, and
   `cpu_ms_per_token` counts the CPU time of every process of the swarm and the client (the checkers' work
   included), which other load does not change.
2. Detection: `bad` is armed (SIGUSR1) and `tail` stopped, so sessions route through `bad` (tail2 is slower). 20 seeded
   runs at verify_rate 0.1, each a fresh client told that every server passed a check before (as if `bad` turned
   bad after its first check: otherwise the first-step check catches it at step 1 every time). Per run: the step
   (generated token) at which `bad` is distrusted, the seconds from the start of `generate`, and whether the output
   equals the local HF model's greedy output.

    PYTHONPATH=src python3 bench/bench_verify.py [--runs 5] [--new-tokens 64] [--detection-runs 20]
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

from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.cli.local_swarm import LocalSwarm
from corolla.client.trust.spot_checks import client_checks

SERVER_ARGS = ["--num-threads", "1", "--announce-period", "2", "--max-session-length", "1024"]
RATES = (0.0, 0.05, 0.1, 0.25)
PROMPT = torch.tensor([[1, *range(20, 35)]])  # 16 tokens


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def peer_id(log_text: str) -> str:
    for line in log_text.splitlines():
        if "serving blocks" in line and " as " in line:
            return line.split(" as ")[1].split()[0]
    raise RuntimeError(f"no peer id in log:\n{log_text}")


class Watch:
    """Streamer: notes the generated token (step) at which `peer` became distrusted, and when."""

    def __init__(self, manager, peer: str):
        self.manager, self.peer = manager, peer
        self.seen, self.step, self.at = -1, None, None
        self.start = time.perf_counter()

    def put(self, value) -> None:
        self.seen += 1
        if self.step is None and self.peer in self.manager.distrusted:
            self.step, self.at = self.seen, time.perf_counter() - self.start

    def end(self) -> None:
        if self.step is None and self.peer in self.manager.distrusted:  # caught by the checks waited for at the end
            self.step, self.at = self.seen, time.perf_counter() - self.start


def cpu_seconds(pgids: set[int]) -> float:
    """User + system CPU seconds of every live process in these process groups (servers, their p2pd, the client)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # fields after the name: state, ppid, pgrp, ..., utime (12), stime (13)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def run_once(
    path: str,
    peers: list[str],
    rate: float,
    seed: int,
    new_tokens: int,
    watch_peer: str | None = None,
    trust: list[str] = (),
    pgids: set[int] = frozenset(),
) -> dict:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=peers, client_config=ClientConfig(verify_rate=rate, verify_seed=seed)
    )
    try:
        checks = client_checks(model.transformer.manager)
        for peer in trust:
            checks.reputation.passed(peer)
        with model.inference_session(max_length=PROMPT.shape[1] + new_tokens + 1) as session:
            if watch_peer is None:  # speed: warm the route (and its first-step checks) outside the timing
                model.generate(PROMPT[:, :2], max_new_tokens=1, session=session)
                session.rollback(0)
            watch = Watch(model.transformer.manager, watch_peer) if watch_peer else None
            begin, cpu = time.perf_counter(), cpu_seconds(pgids)
            out = model.generate(PROMPT, max_new_tokens=new_tokens, session=session, streamer=watch)
            elapsed = time.perf_counter() - begin
            cpu = cpu_seconds(pgids) - cpu
            rewinds = list(session.checks.rewinds) if session.checks is not None else []
        record = {peer: dict(rec) for peer, rec in model.reputation().items()}
        return {
            "out": out,
            "seconds": elapsed,
            "tokens_per_s": new_tokens / elapsed,
            "cpu_ms_per_token": 1000 * cpu / new_tokens,
            "reputation": record,
            "checks": checks.checks_started,
            "rewinds": rewinds,
            "step": None if watch is None else watch.step,
            "detect_s": None if watch is None else watch.at,
        }
    finally:
        model.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--detection-runs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
        reference = LlamaForCausalLM(config).eval()
        reference.save_pretrained(path)
        expected = reference.generate(PROMPT, max_new_tokens=args.new_tokens, do_sample=False)
        os.environ["COROLLA_CACHE"] = str(Path(tmp) / "client-cache")  # the benchmark's reputation file
        with LocalSwarm(env={"COROLLA_CACHE": str(Path(tmp) / "cache")}) as local:
            peers = local.start_dht()
            servers = {
                "head": ("0:2", "1000"),
                "head2": ("0:2", "10"),
                "tail": ("2:4", "1000"),
                "tail2": ("2:4", "1"),
                "bad": ("2:4", "10"),
            }
            procs = {
                name: local.start_server(
                    str(path),
                    [
                        "--blocks",
                        blocks,
                        "--throughput",
                        tp,
                        *SERVER_ARGS,
                        *(["--inject-fault", "corrupt"] if name == "bad" else []),
                    ],
                    name=name,
                    wait=False,
                )
                for name, (blocks, tp) in servers.items()
            }
            for proc in procs.values():
                local.wait_ready(proc)
            ids = {name: peer_id(proc.tail(200)) for name, proc in procs.items()}
            log(f"swarm up: {ids}")

            pgids = {os.getpgrp(), *(os.getpgid(proc.popen.pid) for proc in procs.values())}
            speed: dict[float, list[float]] = {rate: [] for rate in RATES}
            cpu: dict[float, list[float]] = {rate: [] for rate in RATES}
            ratio: dict[float, list[float]] = {rate: [] for rate in RATES}
            honest_checks = honest_failed = 0
            exact = True
            for run in range(args.runs):
                order = RATES[run % len(RATES) :] + RATES[: run % len(RATES)]  # rotate: no rate always runs first
                results = {}
                for rate in order:
                    results[rate] = result = run_once(
                        str(path), peers, rate, seed=run, new_tokens=args.new_tokens, pgids=pgids
                    )
                    speed[rate].append(result["tokens_per_s"])
                    cpu[rate].append(result["cpu_ms_per_token"])
                    honest_checks += result["checks"]
                    honest_failed += sum(rec["failed"] for rec in result["reputation"].values())
                    exact &= bool(torch.equal(result["out"], expected))
                    log(
                        f"run {run} rate {rate}: {result['tokens_per_s']:.1f} tok/s, {result['cpu_ms_per_token']:.1f} "
                        f"CPU ms/token, {result['checks']} checks"
                    )
                for rate in RATES:  # the same round's rate-0 run as the baseline: drifts in the machine's load cancel
                    ratio[rate].append(results[rate]["tokens_per_s"] / results[0.0]["tokens_per_s"])

            # detection: `bad` armed and preferred
            local.kill(procs["tail"], signal.SIGTERM)  # now `bad` is the fastest server of 2:4, tail2 its checker
            procs["bad"].popen.send_signal(signal.SIGUSR1)
            time.sleep(3.0)
            detection = []
            for seed in range(args.detection_runs):
                result = run_once(
                    str(path),
                    peers,
                    0.1,
                    seed=1000 + seed,
                    new_tokens=args.new_tokens,
                    watch_peer=ids["bad"],
                    trust=list(ids.values()),
                )
                detection.append(
                    {
                        "seed": 1000 + seed,
                        "step": result["step"],
                        "seconds": result["detect_s"],
                        "rewinds": result["rewinds"],
                        "equals_hf": bool(torch.equal(result["out"], expected)),
                    }
                )
                log(f"detection run {seed}: {detection[-1]}")

    base = statistics.median(speed[0.0])
    steps = [d["step"] for d in detection if d["step"] is not None]
    secs = [d["seconds"] for d in detection if d["seconds"] is not None]
    print(
        json.dumps(
            {
                "swarm": "loopback, random Llama hidden 256 x 4 blocks, spans 0:2 and 2:4 each replicated, float32, "
                "1 thread",
                "new_tokens": args.new_tokens,
                "runs_per_rate": args.runs,
                "tokens_per_s_median": {str(rate): round(statistics.median(v), 2) for rate, v in speed.items()},
                "slowdown_vs_rate_0": {
                    str(rate): round(1 - statistics.median(v) / base, 4) for rate, v in speed.items()
                },
                "slowdown_paired_median": {str(rate): round(1 - statistics.median(v), 4) for rate, v in ratio.items()},
                "cpu_ms_per_token_median": {str(rate): round(statistics.median(v), 2) for rate, v in cpu.items()},
                "tokens_per_s_runs": {str(rate): [round(x, 2) for x in v] for rate, v in speed.items()},
                "honest": {"checks": honest_checks, "false_positives": honest_failed, "outputs_equal_hf": exact},
                "detection_at_rate_0.1": {
                    "runs": len(detection),
                    "detected": len(steps),
                    "steps_median": statistics.median(steps) if steps else None,
                    "steps_max": max(steps) if steps else None,
                    "steps": steps,
                    "seconds_median": round(statistics.median(secs), 3) if secs else None,
                    "seconds_max": round(max(secs), 3) if secs else None,
                    "outputs_equal_hf": sum(d["equals_hf"] for d in detection),
                },
                "detection_runs": detection,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
