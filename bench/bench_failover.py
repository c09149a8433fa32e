"""Benchmark: how fast a session recovers from a killed server, and how fast a route is planned.

Failover: a local swarm of a tiny random Llama (4 blocks) with every span replicated: two servers hold 0:2 and
two hold 2:4. Each trial opens a session and generates 30 greedy tokens; after a random number of tokens it
SIGKILLs the server behind a randomly chosen span of the session. The failover time is from the kill to the next
token reaching the streamer (detecting the failure, re-routing, opening a stream to the replica, replaying the
session's history, and finishing the step). The killed server is then restarted so every span keeps a replica.
Every trial's tokens are compared with the local HF model's.

Routing: a simulated swarm of 50 servers over an 80-block model (random spans of 4-24 blocks redrawn until every block
is
covered, random throughput, half the servers without cache room, random client round trips of 1-200 ms); times
`find_route` for the whole model, median of many plans.

    python bench/bench_failover.py --kills 20
Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM
from corolla.cli.local_swarm import LocalProcess, LocalSwarm
from corolla.client.swarm.routing import find_route, uncovered_blocks
from corolla.protocol.messages import ServerInfo, ServerState

SERVER_ARGS = ["--num-threads", "1", "--announce-period", "5", "--max-session-length", "1024"]
SPANS = ("0:2", "0:2", "2:4", "2:4")
NEW_TOKENS = 30


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class KillAt:
    """Streamer: at generated token `n`, SIGKILL the server behind span `span_index`; time until the next token."""

    def __init__(self, n: int, span_index: int, session, local: LocalSwarm, by_peer: dict[str, LocalProcess]):
        self.n, self.span_index, self.session, self.local, self.by_peer = n, span_index, session, local, by_peer
        self.seen, self.killed_at, self.failover_s, self.victim = -1, None, None, None

    def put(self, value) -> None:
        self.seen += 1
        if self.killed_at is not None and self.failover_s is None:
            self.failover_s = time.perf_counter() - self.killed_at
        if self.seen == self.n:
            peer = self.session.route[self.span_index].peer_id
            self.victim = peer
            self.killed_at = time.perf_counter()
            self.local.kill(self.by_peer[peer], signal.SIGKILL)

    def end(self) -> None:
        pass


def bench_failover(kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-llama"
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=1,
            eos_token_id=None,
        )
        LlamaForCausalLM(config).eval().save_pretrained(path)
        ids = torch.tensor([[1, 11, 22, 33, 44]])
        expected = (
            LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
            .eval()
            .generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        )
        with LocalSwarm(env={"COROLLA_CACHE": str(Path(tmp) / "cache")}) as local:
            peers = local.start_dht()

            def start(blocks: str) -> LocalProcess:
                return local.start_server(str(path), ["--blocks", blocks, *SERVER_ARGS], wait=False)

            procs = [start(blocks) for blocks in SPANS]
            for proc in procs:
                local.wait_ready(proc)
            by_peer = {_peer_id(p): p for p in procs}
            model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=peers)
            trials = []
            try:
                for trial in range(kills):
                    position, span_index = rng.randrange(1, NEW_TOKENS - 1), rng.randrange(2)
                    with model.inference_session(max_length=64) as session:
                        streamer = KillAt(position, span_index, session, local, by_peer)
                        out = model.generate(ids, max_new_tokens=NEW_TOKENS, session=session, streamer=streamer)
                    identical = bool(torch.equal(out, expected))
                    trials.append(
                        {
                            "kill_after_tokens": position,
                            "span": span_index,
                            "identical": identical,
                            "failover_s": round(streamer.failover_s, 4),
                        }
                    )
                    log(
                        f"kill {trial + 1}/{kills}: after token {position}, span {span_index}: "
                        f"{streamer.failover_s * 1e3:.0f} ms, identical={identical}"
                    )
                    dead = by_peer.pop(streamer.victim)
                    replacement = start(SPANS[procs.index(dead)])
                    procs[procs.index(dead)] = replacement
                    local.wait_ready(replacement)
                    by_peer[_peer_id(replacement)] = replacement
            finally:
                model.shutdown()
    times = [t["failover_s"] for t in trials]
    return {
        "kills": len(trials),
        "all_identical": all(t["identical"] for t in trials),
        "failover_s": {
            "median": round(statistics.median(times), 4),
            "p95": round(percentile(times, 0.95), 4),
            "max": round(max(times), 4),
        },
        "trials": trials,
    }


def _peer_id(proc: LocalProcess) -> str:
    for line in proc.tail(200).splitlines():
        if "serving blocks" in line and " as " in line:
            return line.split(" as ")[1].split()[0]
    raise RuntimeError(f"no peer id in the log of {proc.name}")


def simulated_swarm(num_servers: int, num_blocks: int, rng: random.Random) -> tuple[list[dict], dict[str, float]]:
    """Random servers (spans, throughput, half of them without cache room, client round trips), re-drawn until
    every block has a server."""
    while True:
        block_servers, rtts = _random_servers(num_servers, num_blocks, rng)
        if not uncovered_blocks(block_servers, 0, num_blocks):
            return block_servers, rtts


def _random_servers(num_servers: int, num_blocks: int, rng: random.Random) -> tuple[list[dict], dict[str, float]]:
    block_servers: list[dict[str, ServerInfo]] = [{} for _ in range(num_blocks)]
    rtts = {}
    for i in range(num_servers):
        length = rng.randint(4, 24)
        start = rng.randrange(0, num_blocks - length + 1)
        info = ServerInfo(
            state=ServerState.ONLINE,
            start_block=start,
            end_block=start + length,
            throughput=rng.uniform(5, 500),
            cache_tokens_total=10000,
            cache_tokens_free=rng.choice([0, 10000]),
            torch_dtype="float32",
            version="0",
            protocol_version=1,
            max_session_length=4096,
        )
        peer = f"peer{i:02d}"
        rtts[peer] = rng.uniform(0.001, 0.2)
        for block in range(start, start + length):
            block_servers[block][peer] = info
    return block_servers, rtts


def bench_routing(plans: int, seed: int) -> dict:
    rng = random.Random(seed)
    times, hops = [], []
    for _ in range(plans):
        block_servers, rtts = simulated_swarm(50, 80, rng)
        begin = time.perf_counter()
        route = find_route(block_servers, 0, 80, rtts=rtts, cache_tokens_needed=2048)
        times.append(time.perf_counter() - begin)
        assert route is not None
        hops.append(len(route))
    return {
        "servers": 50,
        "blocks": 80,
        "plans": plans,
        "plan_ms": {"median": round(statistics.median(times) * 1e3, 3), "p95": round(percentile(times, 0.95) * 1e3, 3)},
        "hops_median": statistics.median(hops),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="failover trials (each kills one server)")
    parser.add_argument("--plans", type=int, default=200, help="simulated swarms to plan a route in")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-failover", action="store_true", help="only the routing benchmark")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {"routing": bench_routing(args.plans, args.seed)}
    log(f"routing: {report['routing']['plan_ms']}")
    if not args.skip_failover:
        report["failover"] = bench_failover(args.kills, args.seed)
    report["goals"] = {
        "route_plan_50_servers_lt_20ms": report["routing"]["plan_ms"]["median"] < 20,
        **(
            {}
            if args.skip_failover
            else {
                "failover_p95_le_2s": report["failover"]["failover_s"]["p95"] <= 2.0,
                "every_output_identical": report["failover"]["all_identical"],
            }
        ),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
