"""Every attack of the trust model (docs/security.md) against real local swarms: one verdict line each, then JSON.

Each attack is performed for real, by a hostile peer of this process (corolla.testing) or by a `corolla serve
--inject-fault MODE` liar on the route, against `corolla dht` / `corolla serve` / `corolla api` processes on
127.0.0.1 over a tiny random Llama this script writes. A verdict line reads

    DEFENDED  <attack>: <what happened>          (the attack failed: what the trust model requires)
    BROKEN    <attack>: <what happened>          (the attack worked)

and the last line on stdout is a JSON summary ({"attacks": [...], "defended": n, "broken": n}). Progress on stderr.

    python bench/bench_attacks.py [--only dht,server,push,route,private,api,monitor]

Groups: dht (forged, squatting, shadowing, replayed and flooding records), server (per-peer limits: cache queue,
probes, passes, stream/session flood), push (pushing into, rolling back or reading another client's session;
unauthorized push frames), route (servers on the route that push corrupt outputs, lie to checkers, claim another
quantization or answer NaN), private (a member of a private swarm erasing another's record), api (a hostile API
caller beside honest ones; keys), monitor (markup in announced strings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.cli.local_swarm import LocalProcess, LocalSwarm
from corolla.dht.node import SwarmNode, create_swarm_node
from corolla.testing.results import AttackResult

SERVER_ARGS = ["--num-threads", "1", "--announce-period", "2", "--max-session-length", "1024"]
PREFERRED, BACKUP = ["--throughput", "1000"], ["--throughput", "10"]
PROMPT = torch.tensor([[1, 11, 22, 33, 44]])
NEW_TOKENS = 20
GROUPS = ("dht", "server", "push", "route", "private", "api", "monitor")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class Loop:
    """An event loop in a thread of its own, for the attacker's and honest peers' nodes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def peer_id(proc: LocalProcess) -> str:
    for line in proc.tail(400).splitlines():
        if "serving blocks" in line and " as " in line:
            return line.split(" as ")[1].split()[0]
    raise RuntimeError(f"no peer id in the log of {proc.name}")


def start(local: LocalSwarm, model: str, servers: dict[str, list[str]]) -> dict[str, LocalProcess]:
    """`corolla serve` for each name -> args (started at once), once all are ready."""
    procs = {
        name: local.start_server(model, [*args, *SERVER_ARGS], name=name, wait=False) for name, args in servers.items()
    }
    for proc in procs.values():
        local.wait_ready(proc)
    return procs


def write_model(directory: Path) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return str(directory)


class Bench:
    def __init__(self, model: str, workdir: Path):
        self.model = model
        self.workdir = workdir
        self.results: list[AttackResult] = []
        reference = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.expected = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)

    def record(self, result: AttackResult) -> None:
        self.results.append(result)
        print(f"{'BROKEN  ' if result.succeeded else 'DEFENDED'}  {result.attack}: {result.details}", flush=True)

    def attempt(self, name: str, action: Callable[[], AttackResult]) -> None:
        log(f"attack: {name}")
        try:
            self.record(action())
        except Exception as e:  # an attack that could not even be run is reported, never hidden
            self.record(AttackResult(name, True, f"the bench failed to run it: {type(e).__name__}: {e}"))

    def swarm(self, stack: ExitStack, **env: str) -> LocalSwarm:
        cache = tempfile.mkdtemp(prefix="cache-", dir=self.workdir)
        return stack.enter_context(LocalSwarm(env={"COROLLA_CACHE": cache, **env}))

    # ------------------------------------------------------------------ generation helpers
    def generate(
        self, peers: list[str], streamer=None, **config
    ) -> tuple[torch.Tensor, set[str], set[str], bool, dict]:
        """Greedy tokens: (them, distrusted peers, banned peers, unverified, reputation)."""
        model = AutoDistributedModelForCausalLM.from_pretrained(
            self.model, initial_peers=peers, client_config=ClientConfig(ping_timeout=10.0, **config)
        )
        try:
            with model.inference_session(max_length=64) as session:
                out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session, streamer=streamer)
                manager = session.manager
                return out, set(manager.distrusted), manager.banned(), session.unverified, model.reputation()
        finally:
            model.shutdown()

    # ------------------------------------------------------------------ groups
    def dht_and_server_and_push(self, groups: set[str]) -> None:
        from corolla.testing import dht_attacks, push_attacks, server_attacks

        with ExitStack() as stack:
            local = self.swarm(stack)
            peers = local.start_dht()
            procs = start(local, self.model, {"a": ["--blocks", "0:2"], "b": ["--blocks", "2:4"]})
            a, b = peer_id(procs["a"]), peer_id(procs["b"])
            prefix = Path(self.model).name
            loop = Loop()
            stack.callback(loop.close)
            if "dht" in groups:
                self.attempt("dht record hijack", lambda: loop.run(dht_attacks.hijack_record(peers, prefix, 0, a)))
                self.attempt("dht key squat", lambda: loop.run(dht_attacks.squat_key(peers, prefix, 2)))
                self.attempt("dht key shadow", lambda: loop.run(dht_attacks.shadow_key(peers, prefix, 0, a)))
                self.attempt(
                    "dht replayed record", lambda: loop.run(dht_attacks.replay_older_record(peers, prefix, 2, b))
                )
                self.attempt("model-index flood", lambda: loop.run(dht_attacks.flood_model_index(peers, entries=64)))
                self.attempt(
                    "block-key flood", lambda: loop.run(dht_attacks.flood_block_keys(peers, prefix, [0, 1], a))
                )

                async def start_newcomer() -> str:
                    proc = await asyncio.to_thread(local.start_server, self.model, ["--blocks", "1:3", *SERVER_ARGS],
                                                   "sybil-newcomer")
                    return peer_id(proc)

                self.attempt("sybils fill block keys", lambda: loop.run(
                    dht_attacks.sybil_fill_block_keys(peers, prefix, [1, 2], start_newcomer, wait=2.0)))
                self.attempt("sybils outvote a model", lambda: loop.run(
                    dht_attacks.sybil_model_claims(peers, prefix, 4)))
                out, *_ = self.generate(peers)
                self.record(
                    AttackResult(
                        "dht: a new client after the attacks",
                        not torch.equal(out, self.expected),
                        "greedy output equals HF's" if torch.equal(out, self.expected) else "output differs",
                    )
                )
            nodes: list[SwarmNode] = [loop.run(create_swarm_node(peers, client_mode=True)) for _ in range(2)]
            stack.callback(lambda: [loop.run(n.shutdown()) for n in nodes])
            attacker, honest = nodes
            if "server" in groups:
                # memory is measured by the probe attack: it goes first (the cache queue attack may legitimately get
                # a whole-budget cache allocated to the attacker, which the process keeps as freed memory)
                self.attempt(
                    "probe amplification",
                    lambda: loop.run(server_attacks.probe_attack(attacker.p2p, a, procs["a"].pid, probes=8)),
                )
                self.attempt("forward batch", lambda: loop.run(server_attacks.pass_attack(attacker.p2p, a)))
                self.attempt(
                    "stream and session flood",
                    lambda: loop.run(
                        server_attacks.flood_attack(
                            attacker.p2p, honest.p2p, a, procs["a"].pid, sessions=400, streams=300
                        )
                    ),
                )
                self.attempt(
                    "cache queue", lambda: loop.run(server_attacks.cache_queue_attack(attacker.p2p, honest.p2p, a))
                )
            if "push" in groups:
                self.push_attacks(peers, procs, attacker, loop, push_attacks)

    def push_attacks(
        self, peers: list[str], procs: dict[str, LocalProcess], attacker: SwarmNode, loop: Loop, push_attacks
    ) -> None:
        from corolla.testing.server_attacks import process_rss_mib

        a, b = peer_id(procs["a"]), peer_id(procs["b"])
        model = AutoDistributedModelForCausalLM.from_pretrained(self.model, initial_peers=peers)
        try:
            with model.inference_session(max_length=64) as session:
                model.generate(PROMPT[:, :3], max_new_tokens=2, session=session)
                spans = session.chain.spans
                held = session.position
                for name, secret, position in [
                    ("push confused deputy (overwrite)", "0" * 32, 0),
                    ("push confused deputy (read)", "1" * 32, 2),
                    ("push confused deputy (leaked secret)", spans[0].secret, 0),
                ]:
                    attempt = loop.run(
                        push_attacks.push_through_upstream(
                            attacker, a, (0, 2), b, secret, torch.randn(1, 3, 64), position=position
                        )
                    )
                    leaked = len(attempt.outputs) > 1
                    self.record(
                        AttackResult(
                            name,
                            leaked or session.position != held,
                            f"the attacker got {len(attempt.outputs)} output(s) (its own step's); "
                            f"answers: {', '.join(attempt.answers)[:160]}",
                        )
                    )
                attempt = loop.run(push_attacks.push_directly(attacker, b, spans[0].secret, torch.zeros(1, 1, 64), 0))
                self.record(
                    AttackResult(
                        "push from a peer the owner did not name",
                        not attempt.answers[0].startswith("error"),
                        attempt.answers[0][:160],
                    )
                )
                out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session)
                self.record(
                    AttackResult(
                        "push attacks: the victim's session afterwards",
                        not torch.equal(out, self.expected),
                        "greedy output equals HF's" if torch.equal(out, self.expected) else "output differs",
                    )
                )
        finally:
            model.shutdown()
        before = process_rss_mib(procs["b"].pid)
        answers = loop.run(push_attacks.unauthorized_push_frames(attacker, b, frames=4, announced=128 << 20))
        after = process_rss_mib(procs["b"].pid)
        self.record(
            AttackResult(
                "push frames before authorization",
                after - before > 64 or "exceeds the limit" not in answers,
                f"4 frames announcing 128 MiB: {answers[:120]}; server RSS {before:.0f} -> {after:.0f} MiB",
            )
        )
        flood = loop.run(push_attacks.push_frame_flood(attacker, b, procs["b"].pid, (2, 4), hidden_size=64,
                                                       batch_size=8, max_length=1024, streams=16, hold=6.0))
        grown, frame_mib = flood.rss_peak - flood.rss_before, flood.frame_bytes / 2**20
        self.record(
            AttackResult(
                "push frames of a session naming its own owner as pusher",
                grown > 2 * frame_mib + 16,
                f"16 streams each sending a {frame_mib:.1f} MiB frame (one step of the attacker's own session), never "
                f"completed: server RSS {flood.rss_before:.0f} -> peak {flood.rss_peak:.0f} MiB",
            )
        )

    def route(self) -> None:
        three = {"first": ["--blocks", "0:1"], "middle": ["--blocks", "1:3"], "last": ["--blocks", "3:4"]}
        liar, replica = "middle", "replica"
        for name, fault in [("push framing (corrupt pushes)", "corrupt-push"),
                            ("pushes unlike their receipts (a stall nobody is blamed for)", "misdigest-push"),
                            ("pushes of steps the client never sent (a silent cache rewrite)", "rewrite-push"),
                            ("NaN answers", "nan")]:
            with ExitStack() as stack:
                local = self.swarm(stack)
                peers = local.start_dht()
                servers = dict(three)
                servers[liar] = [*three[liar], *PREFERRED, "--inject-fault", fault]
                servers[replica] = [*three[liar], *BACKUP]
                procs = start(local, self.model, servers)
                ids = {n: peer_id(p) for n, p in procs.items()}
                arm = ArmAt(4, procs[liar])
                out, distrusted, banned, _, _ = self.generate(peers, arm)
                honest = {ids[n] for n in ("first", "last", replica)}
                ok = torch.equal(out, self.expected) and not (honest & (distrusted | banned))
                fate = "distrusted" if ids[liar] in distrusted else "banned" if ids[liar] in banned else "kept"
                self.record(AttackResult(
                    name, not ok, f"output {'equals' if torch.equal(out, self.expected) else 'differs from'} HF's; "
                                  f"liar {fate}; honest servers blamed: {len(honest & (distrusted | banned))}"))
        for name, servers, liar, honest_names, config in [
            (
                "lying checker (two holders)",
                {
                    "head": ["--blocks", "0:2"],
                    "main": ["--blocks", "2:4", *PREFERRED],
                    "liar": ["--blocks", "2:4", *BACKUP, "--inject-fault", "lie-to-checkers"],
                },
                "liar",
                ("head", "main"),
                dict(verify_rate=1.0, verify_seed=0),
            ),
            (
                "claimed quantization",
                {
                    "head": ["--blocks", "0:2"],
                    "liar": ["--blocks", "2:4", *PREFERRED, "--inject-fault", "false-quant"],
                    "honest": ["--blocks", "2:4", *BACKUP],
                },
                "liar",
                ("head", "honest"),
                dict(verify_rate=0.05, verify_seed=0),
            ),
        ]:
            with ExitStack() as stack:
                local = self.swarm(stack)
                peers = local.start_dht()
                procs = start(local, self.model, servers)
                ids = {n: peer_id(p) for n, p in procs.items()}
                procs[liar].popen.send_signal(signal.SIGUSR1)
                out, distrusted, _, unverified, _ = self.generate(peers, **config)
                ok = (
                    torch.equal(out, self.expected)
                    and ids[liar] in distrusted
                    and not distrusted & {ids[n] for n in honest_names}
                )
                self.record(
                    AttackResult(
                        name,
                        not ok,
                        f"output {'equals' if torch.equal(out, self.expected) else 'differs from'} "
                        f"HF's; liar {'distrusted' if ids[liar] in distrusted else 'kept'}; honest distrusted: "
                        f"{len(distrusted & {ids[n] for n in honest_names})}; unverified: {unverified}",
                    )
                )

    def private(self) -> None:
        from corolla.membership import load_swarm_key
        from corolla.testing import dht_attacks

        key_path = str(self.workdir / "swarm.key")
        subprocess.run(
            [sys.executable, "-m", "corolla.cli.main", "swarm-key", key_path], check=True, capture_output=True
        )
        with ExitStack() as stack:
            local = self.swarm(stack)
            maddrs = local.start_dht(args=["--swarm-key", key_path])
            procs = start(
                local,
                self.model,
                {"a": ["--blocks", "0:2", "--swarm-key", key_path], "b": ["--blocks", "2:4", "--swarm-key", key_path]},
            )
            loop = Loop()
            stack.callback(loop.close)
            self.attempt(
                "private swarm, member erasing another's record",
                lambda: loop.run(
                    dht_attacks.erase_member_record(
                        maddrs, Path(self.model).name, 0, peer_id(procs["a"]), load_swarm_key(key_path)
                    )
                ),
            )

    def api(self) -> None:
        from corolla.cli.demo_cmd import demo_model_path
        from corolla.testing.api_attacks import api_attacks

        demo = str(demo_model_path())  # the API needs a model with a tokenizer
        with ExitStack() as stack:
            local = self.swarm(stack)
            peers = local.start_dht()
            start(local, demo, {"a": ["--blocks", "0:3"], "b": ["--blocks", "3:6"]})
            for result in api_attacks(demo, peers, self.workdir):
                self.record(result)

    def monitor(self) -> None:
        from corolla.monitor.page import render_page

        hostile = "<!--<script>alert(1)</script>\u2028"
        page = render_page(None, state_url=hostile, refresh_period=1.0)
        config = page[page.index('{"state_url"') :]
        config = config[: config.index("</script>")] if "</script>" in config else config
        leaked = any(bad in config for bad in ("<!--", "<script", "\u2028"))
        self.record(
            AttackResult(
                "monitor page markup",
                leaked,
                "an announced '<!--<script>' string is escaped in the page's embedded JSON"
                if not leaked
                else "markup reached the page's JSON as is",
            )
        )


class ArmAt:
    """Streamer: SIGUSR1 to a process right after the n-th generated token."""

    def __init__(self, n: int, proc: LocalProcess):
        self.n, self.proc, self.seen = n, proc, -1

    def put(self, value) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.proc.popen.send_signal(signal.SIGUSR1)

    def end(self) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of: {', '.join(GROUPS)}")
    args = parser.parse_args()
    groups = {g.strip() for g in args.only.split(",") if g.strip()}
    if groups - set(GROUPS):
        parser.error(f"unknown groups {sorted(groups - set(GROUPS))}; choose among {', '.join(GROUPS)}")
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="corolla-attacks-") as tmp:
        workdir = Path(tmp)
        bench = Bench(write_model(workdir / "tiny-llama"), workdir)
        if groups & {"dht", "server", "push"}:
            bench.dht_and_server_and_push(groups)
        if "route" in groups:
            bench.route()
        if "private" in groups:
            bench.private()
        if "api" in groups:
            bench.api()
        if "monitor" in groups:
            bench.monitor()
    broken = [r for r in bench.results if r.succeeded]
    print(
        json.dumps(
            {
                "attacks": [asdict(r) for r in bench.results],
                "defended": len(bench.results) - len(broken),
                "broken": len(broken),
                "seconds": round(time.perf_counter() - begin, 1),
            }
        )
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
