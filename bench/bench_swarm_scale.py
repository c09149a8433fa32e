"""A real swarm at scale, under churn: N `corolla serve` processes, 100+ DHT peers, C client sessions.

Real `corolla serve` and `corolla dht` processes (forked from one process that has imported the package already,
tests/server_zygote.py, so that 48 servers do not each pay ~3.5 s of CPU for their imports), real hivemind DHT nodes
and p2pd daemons, the real protocol, on this one machine: on loopback (127.0.0.1) by default, or with `--hosts H` on
corolla.netemu's emulated hosts (root only): H server hosts plus one for the bootstrap peers (and the coverage
sampler and `corolla status`), one for the plain DHT peers and one per client process, each host's link a random
one-way delay so that any two hosts are `--rtt-ms LO:HI` apart (round trip); the last `--private-hosts` server hosts
accept no inbound connections (behind a NAT) and their servers reserve relayed addresses through the bootstrap
peers, which run as relays (with extra relays up to the 4 the bundled p2pd wants). Every packet then crosses the
switch, a Python process on the same 2 cores (see docs/benchmarks.md).

What runs:
- 2 bootstrap peers (`corolla dht --identity ... --port ...`, so a replacement comes back at the same multiaddr);
- N servers of a tiny random Llama (`--blocks L` layers, built here), one torch thread each; most choose their
  blocks themselves (`--num-blocks SPAN`), a fraction (`--fixed-fraction`) serve a fixed `--blocks A:B`, spread over
  the model; started `--start-gap` seconds apart;
- `--dht-peers` plain DHT nodes (each its own p2pd) in one helper process, to reach 100+ DHT peers in all;
- C client sessions (`--clients`) in `--client-procs` processes, a thread per session, each with its own
  distributed model (its own DHT node): one greedy generation after another, each compared with the local HF
  model's greedy output for the same prompt;
- churn for `--duration` seconds: every `--churn-period` seconds a server is SIGKILLed (its whole process group,
  p2pd included), SIGTERMed (a clean stop) or a new one starts (keeping about N); at 40% a burst of a quarter of the
  live servers is SIGKILLed at once; at 60% a bootstrap peer is SIGKILLed and restarted 3 s later. With `--hosts`,
  a churn turn may instead cut a server host off the network for `--partition-s` seconds (its cable pulled: its
  servers keep running, unreachable, then come back).

Measured (one JSON object on stdout; progress on stderr): sessions finished / failed / unfinished, HF-equal outputs,
failovers (client.chain.failover.replace_span calls, counted in the clients) and their stall, seconds with any
block uncovered and block-seconds uncovered (corolla.monitor.collect.collect_state, the code behind `corolla
status`, every few seconds; its latency too), first full coverage after the first start, RSS of each server and
each p2pd, idle CPU per server before the clients start, open file descriptors per server and p2pd at the start
and at the end (servers alive through the whole run), and the shutdown: every process stopped with SIGTERM, exit
codes, and processes left in their process groups (orphan p2pd) afterwards.

    python bench/bench_swarm_scale.py --servers 8 --clients 4 --duration 60       # ~3 minutes
    python bench/bench_swarm_scale.py                                              # 48 servers, 32 clients
    sudo python bench/bench_swarm_scale.py --hosts 8 --servers 24 --clients 16     # on 8 emulated server hosts
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
PROMPTS = [[1, 5 + i, 17 + 3 * i, 40 + i, 9 + 2 * i, 60 - i] for i in range(16)]
VOCAB = 128
LOAD_ATTEMPTS = 3  # a client session's model load (its DHT node, its p2pd) on a loaded machine
STATUS_TIMEOUT = 60  # seconds a `corolla status` run may take before it counts as timed out


def log(message: str) -> None:
    print(f"[swarm_scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


# ------------------------------------------------------------------------------------------- /proc readings
def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def uss_mb(pid: int) -> float | None:
    """Memory of the process's own (not shared with the zygote or anyone): Private_Clean + Private_Dirty."""
    try:
        total = 0
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1])
        return round(total / 1024, 1)
    except (OSError, ValueError):
        return None


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 1024)
    return 0.0


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def io_bytes(pid: int) -> int | None:
    """Bytes a process read and wrote through system calls (/proc/PID/io rchar + wchar). For a server's p2pd: every
    byte of its DHT and RPC traffic twice, once between the peers and once through the control socket to its Python
    process (sent: Python -> p2pd -> wire; received: wire -> p2pd -> Python), so half of it is the wire's in + out."""
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(":") for line in f)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return found


def p2pd_of(pid: int) -> int | None:
    for child in children(pid):
        try:
            with open(f"/proc/{child}/comm") as f:
                if "p2pd" in f.read():
                    return child
        except OSError:
            pass
    return None


def group_members(pgids: set[int]) -> dict[int, str]:
    """Live processes (not zombies) whose process group is one of `pgids`: pid -> command name."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            if fields[0] != "Z" and int(fields[2]) in pgids:
                found[int(entry)] = head.split("(", 1)[1]
        except (OSError, IndexError, ValueError):
            pass
    return found


# ------------------------------------------------------------------------------------------- helper processes
def client_main(args: argparse.Namespace) -> int:
    """One client process: `--threads` sessions, each its own distributed model, generating until the deadline;
    one JSON line per generation on stdout."""
    import torch

    torch.set_num_threads(1)
    from corolla import AutoDistributedModelForCausalLM
    from corolla.client.chain import failover
    from corolla.client.config import ClientConfig

    expected = json.loads(Path(args.expected).read_text())
    lock, loading = threading.Lock(), threading.Lock()
    failovers: list[float] = []
    original = failover.replace_span

    async def counted(chain, index, position):
        begin = time.monotonic()
        try:
            return await original(chain, index, position)
        finally:
            stall = time.monotonic() - begin
            with lock:
                failovers.append(stall)
            emit({"event": "failover", "stall": stall})  # at once: a process cut at the end reports no summary

    failover.replace_span = counted

    def emit(record: dict) -> None:
        with lock:
            print(json.dumps(record), flush=True)

    def worker(index: int) -> None:
        model = None
        for attempt in range(LOAD_ATTEMPTS):  # one load at a time per process: p2pd must start within 15 s
            with loading:
                try:
                    model = AutoDistributedModelForCausalLM.from_pretrained(
                        args.model, initial_peers=args.peers.split(","),
                        client_config=ClientConfig(missing_blocks_wait=args.missing_blocks_wait))
                    break
                except Exception as e:  # noqa: BLE001
                    emit({"event": "load_retry" if attempt + 1 < LOAD_ATTEMPTS else "load_failed",
                          "error": f"{type(e).__name__}: {e}"[:300]})
        if model is None:
            return
        emit({"event": "loaded"})
        turn = index
        try:
            while time.time() < args.deadline:
                prompt = PROMPTS[turn % len(PROMPTS)]
                turn += 1
                with lock:
                    before = len(failovers)
                begin = time.time()
                emit({"event": "begin"})
                try:
                    out = model.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False)
                    record = {"ok": True, "equal": out[0].tolist() == expected[str((turn - 1) % len(PROMPTS))]}
                except Exception as e:  # noqa: BLE001 (a failed session is what we count)
                    record = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
                with lock:
                    record["failovers"] = len(failovers) - before  # of this process, while this session ran
                emit({"event": "session", "start": begin, "end": time.time(), **record})
        finally:
            emit({"event": "shutdown_begin"})
            model.shutdown()
            emit({"event": "shutdown_done"})

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    emit({"event": "failovers", "stalls": list(failovers)})
    sys.stdout.flush()
    os._exit(0)  # whatever the models' loops left behind must not keep the process waiting


def coverage_main(args: argparse.Namespace) -> int:
    """The coverage sampler on an emulated host: one JSON line per sample, lookup or failed reading, until stdin
    closes."""
    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    coverage = Coverage(args.peers.split(","), args.prefix, args.count, args.period, emit=emit)
    coverage.start()
    sys.stdin.read()
    coverage.stop()
    sys.stdout.flush()
    os._exit(0)


def dht_peers_main(args: argparse.Namespace) -> int:
    """`--count` plain DHT nodes (each its own p2pd) in one asyncio loop, until stdin closes or SIGTERM."""
    import asyncio

    from corolla.dht import create_swarm_node

    async def run() -> None:
        nodes = []
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not os.read(sys.stdin.fileno(), 1) else None)
        try:
            for _ in range(args.count):
                if stop.is_set():
                    break
                try:
                    nodes.append(await create_swarm_node(args.peers.split(","), host=args.listen))
                except Exception as e:  # noqa: BLE001 (a bootstrap that did not answer in time, on a loaded machine)
                    print(json.dumps({"event": "dht_peer_failed", "error": f"{type(e).__name__}: {e}"[:200]}),
                          flush=True)
                    await asyncio.sleep(1.0)
                    continue
                print(json.dumps({"event": "dht_peer", "n": len(nodes)}), flush=True)
            await stop.wait()
        finally:
            await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)

    asyncio.run(run())
    sys.stdout.flush()
    os._exit(0)


class Helper:
    """This script in another role, in its own process group; its stdout's JSON lines collected."""

    def __init__(self, argv: list[str], env: dict[str, str], stderr: IO[str] | None = None,
                 netns: str | None = None):
        prefix = ["ip", "netns", "exec", netns] if netns else []  # on an emulated host
        self.popen = subprocess.Popen([*prefix, sys.executable, str(Path(__file__).resolve()), *argv],
                                      stdout=subprocess.PIPE,
                                      stderr=stderr if stderr is not None else subprocess.DEVNULL,
                                      stdin=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.records: list[dict] = []
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                self.records.append(json.loads(line))
            except ValueError:
                pass

    def stop(self, grace: float) -> int | None:
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
        except OSError:
            pass
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        code = self.popen.returncode
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except OSError:
            pass
        self.thread.join(timeout=5)
        return code


# ------------------------------------------------------------------------------------------- the swarm
class Coverage:
    """collect_state every `period` seconds in a thread: seconds with any block uncovered, block-seconds, latency.

    With `helper` (an emulated host's, `--role coverage`), the sampling runs there and this object reads its records;
    `emit` (in that helper) prints each record as it is taken."""

    def __init__(self, peers: list[str], prefix: str, blocks: int, period: float, helper: Helper | None = None,
                 emit=None):
        self.peers, self.prefix, self.blocks, self.period = peers, prefix, blocks, period
        self.helper, self.emit = helper, emit
        self._samples: list[dict] = []
        self._lookups: list[tuple[float, float]] = []  # (when, seconds) of a DHT lookup of every block's records
        self._errors = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def samples(self) -> list[dict]:
        if self.helper is None:
            return self._samples
        return [r for r in list(self.helper.records) if r.get("event") == "sample"]

    @property
    def lookups(self) -> list[tuple[float, float]]:
        if self.helper is None:
            return self._lookups
        return [(r["t"], r["seconds"]) for r in list(self.helper.records) if r.get("event") == "lookup"]

    @property
    def errors(self) -> int:
        if self.helper is None:
            return self._errors
        return sum(1 for r in list(self.helper.records) if r.get("event") == "sample_error")

    def start(self) -> None:
        if self.helper is None:
            self.thread.start()

    def stop(self) -> None:
        if self.helper is not None:
            self.helper.stop(grace=60)
            return
        self._stop.set()
        self.thread.join(timeout=60)

    def _error(self) -> None:
        self._errors += 1
        if self.emit:
            self.emit({"event": "sample_error"})

    def _run(self) -> None:
        from corolla.client.event_loop import run_sync
        from corolla.dht import fetch_block_servers
        from corolla.monitor.collect import collect_state
        from corolla.monitor.source import join_swarm

        node = run_sync(join_swarm(self.peers), timeout=60)
        try:
            while not self._stop.is_set():
                turn = begin = time.monotonic()
                try:  # a lookup as a client's view refresh does it, timed alone
                    run_sync(fetch_block_servers(node.dht, self.prefix, range(self.blocks)), timeout=60)
                    self._lookups.append((begin, time.monotonic() - begin))
                    if self.emit:
                        self.emit({"event": "lookup", "t": begin, "seconds": self._lookups[-1][1]})
                except Exception:  # noqa: BLE001
                    self._error()
                begin = time.monotonic()
                try:
                    state = run_sync(collect_state(node, models={self.prefix: self.blocks}, ping_timeout=3.0,
                                                   max_pings=64), timeout=60)
                    view = state.models[0] if state.models else None
                    self._samples.append({
                        "t": time.monotonic(), "latency": time.monotonic() - begin,
                        "uncovered": list(view.uncovered_blocks) if view else list(range(self.blocks)),
                        "coverage": list(view.coverage) if view else [0] * self.blocks,
                        "online": view.servers_online if view else 0, "mem_available_mb": mem_available_mb(),
                        "load1": os.getloadavg()[0]})
                    if self.emit:
                        self.emit({"event": "sample", **self._samples[-1]})
                except Exception:  # noqa: BLE001
                    self._error()
                self._stop.wait(max(0.0, self.period - (time.monotonic() - turn)))
        finally:
            run_sync(node.shutdown(), timeout=30)

    def summary(self, since: float) -> dict:
        samples = [s for s in self.samples if s["t"] >= since]
        any_s = block_s = 0.0
        for a, b in zip(samples, samples[1:]):
            if a["uncovered"]:
                any_s += b["t"] - a["t"]
                block_s += (b["t"] - a["t"]) * len(a["uncovered"])
        latencies = [s["latency"] for s in samples]
        lookups = [seconds for when, seconds in self.lookups if when >= since]
        spreads = [max(s["coverage"]) - min(s["coverage"]) for s in samples if s["coverage"]]
        return {"samples": len(samples), "errors": self.errors, "any_block_uncovered_s": round(any_s, 1),
                "uncovered_block_seconds": round(block_s, 1),
                "samples_with_uncovered": sum(1 for s in samples if s["uncovered"]),
                "status_latency_s": {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99),
                                     "max": round(max(latencies), 3) if latencies else None},
                "dht_lookup_s": {"p50": pct(lookups, 0.5), "p99": pct(lookups, 0.99),
                                 "max": round(max(lookups), 3) if lookups else None, "count": len(lookups)},
                "coverage_spread_p50": pct(spreads, 0.5),
                "mem_available_mb_min": min((s["mem_available_mb"] for s in samples), default=None),
                "load1_p50": pct([s["load1"] for s in samples], 0.5),
                "last_coverage": samples[-1]["coverage"] if samples else None}

    def first_full(self, since: float) -> float | None:
        for s in self.samples:
            if s["t"] >= since and not s["uncovered"]:
                return round(s["t"] - since, 1)
        return None


class Hosts:
    """The emulated hosts of a `--hosts H` run (corolla.netemu): `boot` (bootstrap peers and relays, the coverage
    sampler, `corolla status`), `peers` (the plain DHT peers), `c0`.. (one per client process) and `h0`..`h{H-1}`
    (the servers, taken in turn). Each host's link gets a one-way delay drawn in [LO/4, HI/4], so that two hosts are
    2 x (their delays' sum), within [LO, HI], apart; the last `private` server hosts accept no inbound connections."""

    def __init__(self, count: int, client_procs: int, rtt_ms: tuple[float, float], private: int,
                 rng: random.Random):
        from corolla.netemu import EmulatedNetwork, can_emulate

        possible, why = can_emulate()
        if not possible:
            raise SystemExit(f"--hosts needs emulated hosts: {why}")
        self.servers = [f"h{i}" for i in range(count)]
        self.clients = [f"c{i}" for i in range(client_procs)]
        names = ["boot", "peers", *self.clients, *self.servers]
        low, high = rtt_ms
        self.delays = {name: rng.uniform(low, high) / 4000 for name in names}
        self.private = self.servers[count - private:] if private else []
        self.net = EmulatedNetwork(names, delays=self.delays, private=self.private)
        self.cut: set[str] = set()  # server hosts now partitioned
        self._turn = 0

    def netns(self, host: str) -> str:
        return self.net.namespace(host)

    def next_server_host(self) -> str:
        host = self.servers[self._turn % len(self.servers)]
        self._turn += 1
        return host

    def partition(self, host: str, seconds: float) -> None:
        """Pull `host`'s cable for `seconds` (a timer puts it back)."""
        self.net.set_link(host, up=False)
        self.cut.add(host)

        def heal() -> None:
            try:
                self.net.set_link(host, up=True)
            except (RuntimeError, ValueError):  # the network closed first
                pass
            self.cut.discard(host)
        timer = threading.Timer(seconds, heal)
        timer.daemon = True
        timer.start()

    def describe(self) -> dict:
        rtts = [2000 * (self.delays[a] + self.delays[b]) for i, a in enumerate(self.servers)
                for b in self.servers[i + 1:]]
        return {"network": "emulated hosts", "server_hosts": len(self.servers), "private_hosts": self.private,
                "server_rtt_ms": {"min": round(min(rtts), 1) if rtts else None,
                                  "p50": pct(rtts, 0.5), "max": round(max(rtts), 1) if rtts else None}}

    def close(self) -> None:
        self.net.close()


def time_status_cli(peers: list[str], prefix: str, blocks: int, env: dict[str, str], runs: int = 3,
                    netns: str | None = None) -> dict:
    """`corolla status --json` as a user runs it (a fresh interpreter: imports, its own DHT node, the look), `runs`
    times, on the emulated host of `netns` if given: wall seconds p50 / max (a run past STATUS_TIMEOUT counts as that
    long), and the servers it saw online at the last run that answered."""
    seconds, online, timeouts = [], None, 0
    prefix_argv = ["ip", "netns", "exec", netns] if netns else []
    argv = [*prefix_argv, sys.executable, "-m", "corolla.cli.main", "status", "--initial-peers", peers[0],
            "--dht-prefix", prefix, "--num-blocks", str(blocks), "--json"]
    for _ in range(runs):
        begin = time.monotonic()
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=STATUS_TIMEOUT)
        except subprocess.TimeoutExpired:
            seconds.append(float(STATUS_TIMEOUT))
            timeouts += 1
            continue
        seconds.append(time.monotonic() - begin)
        try:
            online = json.loads(done.stdout)["servers_online"] if done.returncode == 0 else online
        except (ValueError, KeyError):
            pass
    return {"s_p50": pct(seconds, 0.5), "s_max": round(max(seconds), 2), "servers_online": online,
            "timeouts": timeouts}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: Path, blocks: int) -> dict[str, list[int]]:
    """A tiny random Llama with `blocks` layers (varied greedy output) and its HF greedy outputs for PROMPTS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=blocks,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=None, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return {str(i): model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS[0], do_sample=False)[0].tolist()
            for i, p in enumerate(PROMPTS)}


NEW_TOKENS = [16]


def run(args: argparse.Namespace) -> dict:
    """The whole run; returns the report."""
    sys.path.insert(0, str(TESTS))
    import server_zygote
    from corolla.cli.local_swarm import LocalProcess, LocalSwarm
    from corolla.dht import model_dht_prefix

    NEW_TOKENS[0] = args.new_tokens
    rng = random.Random(args.seed)
    started_at = time.monotonic()
    own_zygote = server_zygote._client is None  # under pytest the session's zygote is shared: leave it running
    server_zygote.start()
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "role"}, "network": "loopback"}
    hosts = None
    if args.hosts:
        low, high = (float(v) for v in args.rtt_ms.split(":"))
        hosts = Hosts(args.hosts, max(1, min(args.client_procs, args.clients)), (low, high), args.private_hosts, rng)
        result["network"] = hosts.describe()
    with tempfile.TemporaryDirectory(prefix="swarm-scale-") as tmp:
        tmp_path = Path(tmp)
        model = str(tmp_path / "tiny-llama")
        expected = build_model(Path(model), args.blocks)
        (tmp_path / "expected.json").write_text(json.dumps(expected))
        env = {**os.environ, "COROLLA_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
        log_file = open(tmp_path / "swarm.log", "w") if not args.log else open(args.log, "w")

        class Swarm(LocalSwarm):
            netns: str | None = None  # the emulated host the next process starts on (None: loopback)

            def _start_process(self, argv: list[str]):
                return server_zygote.start_corolla(argv, self.env, self.netns)

        local = Swarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}, log_file=log_file)
        helpers: list[Helper] = []
        coverage: Coverage | None = None
        all_pgids: set[int] = set()
        listen = ["--host", "0.0.0.0"] if hosts else []  # on an emulated host: its own address, not loopback
        boot_ns = hosts.netns("boot") if hosts else None

        def reachable(maddrs: list[str]) -> list[str]:  # a peer's multiaddrs that other hosts can dial
            return [m for m in maddrs if f"/ip4/{hosts.net.address('boot')}/" in m] if hosts else list(maddrs)
        try:
            # bootstrap peers, each with an identity and a port, so that a replacement has the same multiaddr
            boot_specs = [(str(tmp_path / f"boot{i}.key"), free_port()) for i in range(args.bootstraps)]

            relay = ["--relay"] if hosts and hosts.private else []

            def start_boot(i: int) -> LocalProcess:
                key, port = boot_specs[i]
                local.netns = boot_ns
                local.start_dht(args=["--port", str(port), "--identity", key, *listen, *relay], timeout=120)
                all_pgids.add(local.processes[-1].pid)
                return local.processes[-1]

            boots = []
            for i in range(args.bootstraps):
                boots.append(start_boot(i))
                if i == 0:
                    peers = reachable(local.initial_peers)
                else:
                    peers += [m for m in reachable(local.initial_peers) if m not in peers]
            relays = list(peers) if relay else []
            for _ in range(max(0, 4 - args.bootstraps) if relay else 0):  # the bundled p2pd reserves at once with 4
                local.start_dht(args=[*listen, *relay, "--initial-peers", ",".join(peers)], timeout=120)
                all_pgids.add(local.processes[-1].pid)
                relays += reachable(local.initial_peers)[:1]
            local.initial_peers = peers
            log(f"bootstrap peers: {len(boots)}: {' '.join(peers)}" + (f"; relays: {len(relays)}" if relays else ""))

            if args.dht_peers:  # a fresh interpreter: its imports overlap the servers' start
                helper = Helper(["--role", "dht-peers", "--count", str(args.dht_peers), "--peers", ",".join(peers),
                                 "--listen", "0.0.0.0" if hosts else "127.0.0.1"], env, log_file,
                                netns=hosts.netns("peers") if hosts else None)
                helpers.append(helper)
                all_pgids.add(helper.popen.pid)
            servers: list[LocalProcess] = []
            fixed_count = round(args.servers * args.fixed_fraction)
            fixed_starts = [round(i * (args.blocks - args.span) / max(1, fixed_count - 1)) for i in range(fixed_count)]
            server_args = ["--num-threads", "1", "--announce-period", str(args.announce_period),
                           "--max-session-length", "512", "--throughput", "100", *listen]
            joins: list[float] = []
            counter = [0]
            host_of: dict[int, str] = {}  # server pid -> its emulated host

            def start_server(fixed: int | None = None) -> LocalProcess:
                counter[0] += 1
                blocks = (["--blocks", f"{fixed}:{fixed + args.span}"] if fixed is not None
                          else ["--num-blocks", str(args.span)])
                extra: list[str] = []
                if hosts:
                    host = hosts.next_server_host()
                    local.netns = hosts.netns(host)
                    if host in hosts.private:
                        extra = ["--relays", *relays]
                proc = local.start_server(model, [*blocks, *server_args, *extra], name=f"s{counter[0]}", wait=False)
                if hosts:
                    host_of[proc.pid] = host
                all_pgids.add(proc.pid)
                servers.append(proc)
                begin = time.monotonic()

                def wait() -> None:
                    if proc.ready.wait(300):
                        joins.append(time.monotonic() - begin)
                threading.Thread(target=wait, daemon=True).start()
                return proc

            first_start = time.monotonic()
            sampler = None
            if hosts:  # the sampler must be on a host to reach the others
                sampler = Helper(["--role", "coverage", "--peers", ",".join(peers), "--prefix", model_dht_prefix(model),
                                  "--count", str(args.blocks), "--period", str(args.sample_period)], env, log_file,
                                 netns=boot_ns)
                all_pgids.add(sampler.popen.pid)
            coverage = Coverage(peers, model_dht_prefix(model), args.blocks, args.sample_period, helper=sampler)
            coverage.start()
            for i in range(args.servers):
                start_server(fixed_starts[i] if i < fixed_count else None)
                time.sleep(args.start_gap)
            log(f"{args.servers} servers started; waiting for them to be ready")
            deadline = time.monotonic() + args.ready_timeout
            while time.monotonic() < deadline and not all(p.ready.is_set() or not p.alive() for p in servers):
                time.sleep(1)
            ready = [p for p in servers if p.ready.is_set()]
            result["startup"] = {"ready": len(ready), "of": len(servers), "died": sum(not p.alive() for p in servers),
                                 "all_ready_s": round(time.monotonic() - first_start, 1),
                                 "join_s_p50": pct(joins, 0.5), "join_s_max": round(max(joins), 1) if joins else None}
            log(f"startup: {result['startup']}")
            # idle: CPU, RSS and descriptors with no traffic
            idle_from = {p.pid: cpu_seconds(p.pid) for p in ready}
            p2pds = {p.pid: p2pd_of(p.pid) for p in ready}
            io_from = {pid: io_bytes(p2pd) if p2pd else None for pid, p2pd in p2pds.items()}
            p2pd_cpu_from = {pid: cpu_seconds(p2pd) if p2pd else None for pid, p2pd in p2pds.items()}
            time.sleep(args.idle_window)
            p2pd_pct = [100 * (cpu_seconds(p2pd) - p2pd_cpu_from[pid]) / args.idle_window for pid, p2pd in p2pds.items()
                        if p2pd and p2pd_cpu_from[pid] is not None and cpu_seconds(p2pd) is not None]
            idle_pct = [100 * (cpu_seconds(p.pid) - idle_from[p.pid]) / args.idle_window
                        for p in ready if cpu_seconds(p.pid) is not None and idle_from[p.pid] is not None]
            io_to = {pid: io_bytes(p2pd) if p2pd else None for pid, p2pd in p2pds.items()}
            wire_kb_min = [(io_to[pid] - io_from[pid]) / 2 / 1024 * 60 / args.idle_window for pid in p2pds
                           if io_to[pid] is not None and io_from[pid] is not None]
            start_fds = {p.pid: (fd_count(p.pid), fd_count(p2pds[p.pid] or -1)) for p in ready}
            rss_start = [rss_mb(p.pid) for p in ready]
            uss_start = [uss_mb(p.pid) for p in ready]
            p2pd_rss_start = [rss_mb(p2pds[p.pid] or -1) for p in ready]
            result["idle"] = {"window_s": args.idle_window, "cpu_pct_per_server_p50": pct(idle_pct, 0.5),
                              "p2pd_cpu_pct_p50": pct(p2pd_pct, 0.5),
                              "wire_kib_per_server_per_min_p50": pct(wire_kb_min, 0.5),
                              "wire_kib_per_server_per_min_max": round(max(wire_kb_min), 1) if wire_kb_min else None,
                              "cpu_pct_per_server_max": round(max(idle_pct), 2) if idle_pct else None,
                              "first_full_coverage_s": coverage.first_full(first_start)}
            result["status_cli_idle"] = {**time_status_cli(peers, model_dht_prefix(model), args.blocks, env,
                                                           netns=boot_ns),
                                         "servers_ready": len(ready)}
            log(f"idle: {result['idle']}; corolla status: {result['status_cli_idle']}")

            def plain_peers() -> int:
                return max((r["n"] for r in helpers[0].records if r.get("event") == "dht_peer"), default=0) \
                    if args.dht_peers else 0

            plain = plain_peers()

            # clients
            churn_start = time.monotonic()
            churn_deadline = time.time() + args.warmup + args.duration
            procs = max(1, min(args.client_procs, args.clients))
            per = [args.clients // procs + (i < args.clients % procs) for i in range(procs)]
            clients = [Helper(["--role", "client", "--model", model, "--peers", ",".join(peers), "--threads", str(n),
                               "--expected", str(tmp_path / "expected.json"), "--deadline", str(churn_deadline),
                               "--new-tokens", str(args.new_tokens), "--missing-blocks-wait",
                               str(args.missing_blocks_wait)], env, log_file,
                              netns=hosts.netns(hosts.clients[i]) if hosts else None) for i, n in enumerate(per) if n]
            helpers += clients
            all_pgids.update(c.popen.pid for c in clients)
            log(f"{args.clients} client sessions in {len(clients)} processes; {plain} plain DHT peers; warm-up "
                f"{args.warmup:.0f}s then {args.duration:.0f}s of churn")
            time.sleep(args.warmup)

            # churn
            events = {"sigkill": 0, "sigterm": 0, "started": 0, "burst_killed": 0, "bootstrap_replaced": 0,
                      "partitioned": 0}
            term_codes: list[int | None] = []
            stoppers: list[threading.Thread] = []
            alive_through: set[int] = {p.pid for p in ready}

            def live() -> list[LocalProcess]:
                return [p for p in servers if p.alive() and p.ready.is_set()]

            def sigterm(proc: LocalProcess) -> None:
                proc.popen.send_signal(signal.SIGTERM)
                try:
                    term_codes.append(proc.popen.wait(timeout=60))
                except subprocess.TimeoutExpired:
                    term_codes.append(None)
                    proc.signal_group(signal.SIGKILL)

            begin = time.monotonic()
            end = begin + args.duration
            burst_at, boot_at = begin + 0.4 * args.duration, begin + 0.6 * args.duration
            burst_done = boot_done = False
            peak_servers = len(live())
            while time.monotonic() < end:
                now = time.monotonic()
                alive = live()
                peak_servers = max(peak_servers, len([p for p in servers if p.alive()]))
                if not burst_done and now >= burst_at:
                    victims = rng.sample(alive, max(1, len(alive) // 4))
                    for victim in victims:
                        victim.signal_group(signal.SIGKILL)
                        alive_through.discard(victim.pid)
                    events["burst_killed"] = len(victims)
                    burst_done = True
                    log(f"burst: SIGKILLed {len(victims)} of {len(alive)} servers")
                elif not boot_done and now >= boot_at and boots:
                    victim = boots[0]
                    victim.signal_group(signal.SIGKILL)
                    victim.popen.wait(timeout=10)
                    time.sleep(3)
                    boots[0] = start_boot(0)
                    events["bootstrap_replaced"] += 1
                    boot_done = True
                    log("bootstrap peer 0 SIGKILLed and restarted at the same multiaddr")
                else:
                    starting = sum(1 for p in servers if p.alive() and not p.ready.is_set())
                    below = len(alive) + starting < args.servers
                    action = rng.choice(["start", "start", "kill", "term"] if below else ["start", "kill", "term"])
                    cuttable = sorted({host_of[p.pid] for p in alive if p.pid in host_of} - hosts.cut) if hosts else []
                    if cuttable and rng.random() < 0.25:
                        action = "partition"
                    if action != "start" and len(alive) <= max(2, args.servers // 2):
                        action = "start"
                    if action == "partition":
                        host = rng.choice(cuttable)
                        hosts.partition(host, args.partition_s)
                        events["partitioned"] += 1
                        log(f"host {host} cut off for {args.partition_s:.0f}s "
                            f"({sum(1 for p in alive if host_of.get(p.pid) == host)} servers on it)")
                    elif action == "start":
                        start_server()
                        events["started"] += 1
                    else:
                        victim = rng.choice(alive)
                        alive_through.discard(victim.pid)
                        if action == "kill":
                            victim.signal_group(signal.SIGKILL)
                            events["sigkill"] += 1
                        else:
                            thread = threading.Thread(target=sigterm, args=(victim,), daemon=True)
                            thread.start()
                            stoppers.append(thread)
                            events["sigterm"] += 1
                time.sleep(max(0.0, min(args.churn_period, end - time.monotonic())))
            log(f"churn over: {events}; waiting for the clients' last sessions")
            client_deadline = time.monotonic() + args.session_grace
            for client in clients:
                try:
                    client.popen.wait(timeout=max(1.0, client_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            unfinished_procs = sum(1 for c in clients if c.popen.poll() is None)
            for client in clients:
                client.stop(grace=5)
            for thread in stoppers:
                thread.join(timeout=60)

            sessions = [r for c in clients for r in c.records if r.get("event") == "session"]
            stalls = [r["stall"] for c in clients for r in c.records if r.get("event") == "failover"]
            ok = [s for s in sessions if s["ok"]]
            errors = [s["error"] for s in sessions if not s["ok"]]
            result["sessions"] = {
                "finished": len(ok), "failed": len(errors),
                "unfinished_at_end": sum(1 for c in clients for r in c.records if r.get("event") == "begin")
                - len(sessions), "hf_equal": sum(1 for s in ok if s["equal"]),
                "not_equal": sum(1 for s in ok if not s["equal"]),
                "clients_loaded": sum(1 for c in clients for r in c.records if r.get("event") == "loaded"),
                "client_load_failed": [r["error"] for c in clients for r in c.records if r.get("event") == "load_failed"][:5],
                "client_load_retries": sum(1 for c in clients for r in c.records if r.get("event") == "load_retry"),
                "client_procs_cut_at_end": unfinished_procs,
                "client_model_shutdowns_unfinished": sum(
                    (r.get("event") == "shutdown_begin") - (r.get("event") == "shutdown_done")
                    for c in clients for r in c.records),
                "session_s_p50": pct([s["end"] - s["start"] for s in ok], 0.5),
                "session_s_max": round(max(s["end"] - s["start"] for s in ok), 1) if ok else None,
                "tokens_per_s": round(len(ok) * args.new_tokens / (args.warmup + args.duration), 2),
                "errors": errors[:8],
            }
            result["failovers"] = {"count": len(stalls), "stall_s_p50": pct(stalls, 0.5),
                                   "stall_s_p90": pct(stalls, 0.9), "stall_s_p99": pct(stalls, 0.99),
                                   "stall_s_max": round(max(stalls), 2) if stalls else None,
                                   "over_2s": sum(1 for s in stalls if s > 2.0)}
            result["churn"] = {**events, "sigterm_exit_codes": sorted({str(c) for c in term_codes}),
                               "servers_started_in_all": len(servers)}
            time.sleep(args.idle_window)  # the swarm at rest again before the end readings
            result["status_cli_end"] = {**time_status_cli(peers, model_dht_prefix(model), args.blocks, env,
                                                          netns=boot_ns),
                                        "servers_alive": len(live())}
            result["coverage"] = {**coverage.summary(churn_start),
                                  "first_full_coverage_s": coverage.first_full(first_start)}
            coverage.stop()
            coverage = None
            survivors = [p for p in ready if p.pid in alive_through and p.alive()]
            end_fds = {p.pid: (fd_count(p.pid), fd_count(p2pd_of(p.pid) or -1)) for p in survivors}
            rss_end = [rss_mb(p.pid) for p in live()]
            uss_end = [uss_mb(p.pid) for p in live()]
            p2pd_rss_end = [rss_mb(p2pd_of(p.pid) or -1) for p in live()]
            fd_growth = [end_fds[pid][0] - start_fds[pid][0] for pid in end_fds
                         if end_fds[pid][0] is not None and start_fds[pid][0] is not None]
            p2pd_fd_growth = [end_fds[pid][1] - start_fds[pid][1] for pid in end_fds
                              if end_fds[pid][1] is not None and start_fds[pid][1] is not None]

            def stats(values: list) -> dict:
                values = [v for v in values if v is not None]
                return {"p50": pct(values, 0.5), "max": max(values) if values else None}

            result["processes"] = {
                "server_rss_mb": {"start": stats(rss_start), "end": stats(rss_end)},
                "server_private_mb": {"start": stats(uss_start), "end": stats(uss_end)},
                "p2pd_rss_mb": {"start": stats(p2pd_rss_start), "end": stats(p2pd_rss_end)},
                "server_fds": {"start": stats([v[0] for v in start_fds.values()]),
                               "end": stats([v[0] for v in end_fds.values()])},
                "p2pd_fds": {"start": stats([v[1] for v in start_fds.values()]),
                             "end": stats([v[1] for v in end_fds.values()])},
                "survivors_compared": len(end_fds), "server_fd_growth": stats(fd_growth),
                "p2pd_fd_growth": stats(p2pd_fd_growth),
            }
            result["dht_peers"] = {"bootstrap": len(boots), "servers_peak": peak_servers, "client_sessions": args.clients,
                                   "plain_at_clients_start": plain, "plain": plain_peers(),
                                   "plain_failed_to_join": sum(1 for r in helpers[0].records
                                                               if r.get("event") == "dht_peer_failed")
                                   if args.dht_peers else 0, "coverage_sampler": 1,
                                   "total_peak": len(boots) + peak_servers + args.clients + plain_peers() + 1}

            # shutdown: SIGTERM to every server and bootstrap leader at once, then look for leftovers in their groups
            log("stopping every process with SIGTERM")
            remaining = [p for p in local.processes if p.alive()]
            for proc in remaining:
                proc.popen.send_signal(signal.SIGTERM)
            stop_deadline = time.monotonic() + args.stop_grace
            codes = []
            for proc in remaining:
                try:
                    codes.append(proc.popen.wait(timeout=max(0.1, stop_deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
            time.sleep(1)
            left = group_members({p.pid for p in remaining})
            plain_code = helpers[0].stop(grace=30) if args.dht_peers else None
            result["shutdown"] = {"sigtermed": len(remaining), "exited": sum(c is not None for c in codes),
                                  "exit_codes": {str(c): codes.count(c) for c in set(codes)},
                                  "left_in_groups_after_exit": sorted(set(left.values())), "left_count": len(left),
                                  "plain_dht_helper_exit": plain_code}
        finally:
            if coverage is not None:
                coverage.stop()
            for helper in helpers:
                helper.stop(grace=1)
            local.close(grace=5)
            leftovers = group_members(all_pgids)
            for pid in leftovers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            result.setdefault("shutdown", {})["orphans_after_cleanup"] = len(group_members(all_pgids))
            result["shutdown"]["leftovers_killed_at_cleanup"] = sorted(set(leftovers.values()))
            if own_zygote:
                server_zygote.close()
            if hosts:
                hosts.close()  # ends whatever still runs inside its namespaces, then deletes them
            log_file.close()
    shutdown = result["shutdown"]
    shutdown["clean"] = (shutdown.get("left_count") == 0 and shutdown.get("exited") == shutdown.get("sigtermed")
                         and set(shutdown.get("exit_codes", {})) <= {"0"} and shutdown["orphans_after_cleanup"] == 0)
    result["wall_s"] = round(time.monotonic() - started_at, 1)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=48)
    p.add_argument("--blocks", type=int, default=24, help="layers of the tiny Llama")
    p.add_argument("--span", type=int, default=4, help="blocks per server")
    p.add_argument("--fixed-fraction", type=float, default=0.25, help="servers started with --blocks A:B")
    p.add_argument("--clients", type=int, default=32, help="concurrent client sessions")
    p.add_argument("--client-procs", type=int, default=4, help="processes the sessions are spread over")
    p.add_argument("--dht-peers", type=int, default=24, help="plain DHT peers (one helper process)")
    p.add_argument("--bootstraps", type=int, default=2)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of churn")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of clients before the churn")
    p.add_argument("--churn-period", type=float, default=5.0)
    p.add_argument("--start-gap", type=float, default=0.5, help="seconds between server starts")
    p.add_argument("--announce-period", type=float, default=10.0)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--missing-blocks-wait", type=float, default=60.0,
                   help="ClientConfig.missing_blocks_wait of every session: how long it waits for servers of blocks "
                        "nobody holds (the burst can take every holder of a span) before MissingBlocks; default 5")
    p.add_argument("--sample-period", type=float, default=5.0, help="seconds between coverage samples")
    p.add_argument("--idle-window", type=float, default=15.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--session-grace", type=float, default=120.0, help="seconds the last sessions get after the churn")
    p.add_argument("--stop-grace", type=float, default=120.0)
    p.add_argument("--hosts", type=int, default=0,
                   help="server hosts on corolla.netemu's emulated network (root only); 0: everything on loopback")
    p.add_argument("--rtt-ms", default="30:80", help="with --hosts: LO:HI, the round trips between hosts, ms")
    p.add_argument("--private-hosts", type=int, default=2,
                   help="with --hosts: server hosts behind a NAT (no inbound connections; their servers are relayed)")
    p.add_argument("--partition-s", type=float, default=30.0,
                   help="with --hosts: seconds a partitioned host stays cut off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="write every process's output here")
    # helper roles (this script started by itself)
    p.add_argument("--role", choices=["main", "client", "dht-peers", "coverage"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--peers", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--expected", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--listen", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    p.add_argument("--period", type=float, default=5.0, help=argparse.SUPPRESS)
    return p


def main() -> int:
    args = parser().parse_args()
    if args.role == "client":
        return client_main(args)
    if args.role == "dht-peers":
        return dht_peers_main(args)
    if args.role == "coverage":
        return coverage_main(args)
    if args.hosts and args.private_hosts >= args.hosts:
        parser().error("--private-hosts must leave at least one server host public")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
