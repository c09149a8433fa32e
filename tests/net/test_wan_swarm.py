"""A swarm across emulated hosts: a DHT peer, two servers and a client, each with its own 10.x address, 25-45 ms
apart. Checks the issue-14 guarantees end to end, with real `corolla` processes and a real client."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from corolla.netemu import EmulatedNetwork
from corolla.netemu.swarm import Agent, corolla, start_dht, start_server as _start_server, wait_serving
from netswarm import SERVER_ARGS, needs_namespaces, net_log, reference, wait_until  # noqa: F401 (fixtures)

pytestmark = [needs_namespaces, pytest.mark.net]

# one-way delay of each host's link to the switch: round trips between hosts of 25 to 45 ms
DELAYS = {"dht": 0.005, "a": 0.010, "b": 0.0125, "client": 0.0075}
DHT_PORT = "31337"
SERVER_PORT = "40404"


def start_server(net, host, model, peers, *args, **kwargs):
    return _start_server(net, host, model, peers, *SERVER_ARGS, *args, **kwargs)


def online_peers(agent: Agent, block: int) -> set[str] | None:
    """Peers the client reads as ONLINE for `block` now; None when the DHT read itself failed."""
    reply = agent.request("servers")
    if not reply["ok"]:
        return None
    return {peer for peer, info in reply["blocks"][block].items() if info["state"] == "online"}


@pytest.mark.slow  # a long WAN scenario
def test_four_hosts_generate_like_hf_and_survive_a_dht_restart(tiny_llama_path, reference, tmp_path: Path, net_log):
    identity = tmp_path / "dht.key"
    with EmulatedNetwork(list(DELAYS), delays=DELAYS) as net:
        dht_args = ["--host", "0.0.0.0", "--port", DHT_PORT, "--identity", str(identity)]
        dht, maddrs = start_dht(net, "dht", *dht_args, log=net_log)
        # listening on 0.0.0.0 announces the host's own address, never 0.0.0.0 (nor loopback, with a real one)
        assert maddrs and all(m.startswith(f"/ip4/{net.address('dht')}/tcp/{DHT_PORT}/p2p/") for m in maddrs), maddrs
        assert stat.S_IMODE(os.stat(identity).st_mode) == 0o600

        # a listens on 0.0.0.0 and says where to dial it (as behind a port forward); b announces what it listens on
        announced_a = f"/ip4/{net.address('a')}/tcp/{SERVER_PORT}"
        servers = {
            "a": start_server(net, "a", tiny_llama_path, maddrs, "--blocks", "0:2", "--host", "0.0.0.0", "--port",
                              SERVER_PORT, "--announce-maddrs", announced_a, label="server-a", log=net_log, wait=False),
            "b": start_server(net, "b", tiny_llama_path, maddrs, "--blocks", "2:4", "--host", "0.0.0.0",
                              label="server-b", log=net_log, wait=False),
        }
        peer_ids = {name: wait_serving(proc) for name, proc in servers.items()}
        client = Agent(net, "client", tiny_llama_path, maddrs, log=net_log)
        assert client.ready["ready"], client.ready

        assert client.generate(reference.ids, reference.new_tokens) == reference.tokens
        blocks = client.request("servers")["blocks"]
        assert blocks[0][peer_ids["a"]]["maddrs"] == [f"{announced_a}/p2p/{peer_ids['a']}"]
        announced_b = blocks[2][peer_ids["b"]]["maddrs"]
        assert announced_b and all(m.startswith(f"/ip4/{net.address('b')}/tcp/") for m in announced_b), announced_b

        # the DHT peer restarts with its identity: same peer id, same port, so the same multiaddr
        dht.stop()
        _, maddrs_again = start_dht(net, "dht", *dht_args, label="dht-restarted", log=net_log)
        assert maddrs_again == maddrs
        assert client.generate(reference.ids, reference.new_tokens) == reference.tokens
        # a newcomer joins through the restarted peer, which the servers have pinged again (their SwarmWatch)
        newcomer = Agent(net, "client", tiny_llama_path, maddrs_again, label="client-2", log=net_log)
        assert newcomer.ready["ready"], newcomer.ready
        assert wait_until(lambda: online_peers(newcomer, 3) == {peer_ids["b"]}, timeout=120), newcomer.proc.tail()
        assert newcomer.generate(reference.ids, reference.new_tokens) == reference.tokens


@pytest.mark.slow  # a long WAN scenario
def test_server_cut_off_past_its_record_expiration_comes_back_by_itself(tiny_llama_path, reference, net_log):
    announce = ["--announce-period", "4", "--expiration", "8", "--rejoin-period", "1"]
    with EmulatedNetwork(list(DELAYS), delays=DELAYS) as net:
        _, maddrs = start_dht(net, "dht", "--host", "0.0.0.0", "--rejoin-period", "1", log=net_log)
        servers = {name: start_server(net, name, tiny_llama_path, maddrs, "--blocks", blocks, "--host", "0.0.0.0",
                                      *announce, label=f"server-{name}", log=net_log, wait=False)
                   for name, blocks in (("a", "0:2"), ("b", "2:4"))}
        peer_ids = {name: wait_serving(proc) for name, proc in servers.items()}
        client = Agent(net, "client", tiny_llama_path, maddrs, log=net_log,
                       config={"update_period": 1.0, "unreachable_ban": 2.0, "missing_blocks_wait": 2.0})
        assert client.generate(reference.ids, reference.new_tokens) == reference.tokens

        net.set_link("b", up=False)
        cut = time.monotonic()
        def b_expired() -> bool:
            online = online_peers(client, 3)
            return online is not None and peer_ids["b"] not in online

        assert wait_until(b_expired, timeout=120), "b's record never expired"
        expired_after = time.monotonic() - cut
        time.sleep(max(0.0, 16.0 - expired_after))  # cut off well past the 8 s expiration
        printed = servers["b"].lines_printed
        net.set_link("b", up=True)
        restored = time.monotonic()
        assert wait_until(lambda: peer_ids["b"] in (online_peers(client, 3) or ()), timeout=120), servers["b"].tail()
        back_after = time.monotonic() - restored
        print(f"b's record expired {expired_after:.1f}s into the cut; b was back in the DHT {back_after:.1f}s after "
              f"the link returned (announce period 4 s, client update period 1 s)")
        servers["b"].wait_for("rejoined the swarm", timeout=60, start=printed)
        assert client.generate(reference.ids, reference.new_tokens) == reference.tokens


@pytest.mark.slow  # a WAN scenario of 25 s; the default run keeps the in-process membership and DHT attack tests
def test_private_swarm_keeps_strangers_out_and_members_see_no_difference(tiny_llama_path, reference, tmp_path, net_log):
    key, other_key = tmp_path / "swarm.key", tmp_path / "other.key"
    with EmulatedNetwork([*DELAYS, "stranger"], delays={**DELAYS, "stranger": 0.01}) as net:
        for path in (key, other_key):
            assert net.run("dht", corolla("swarm-key", str(path))).returncode == 0
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        _, maddrs = start_dht(net, "dht", "--host", "0.0.0.0", "--swarm-key", str(key), log=net_log)
        servers = {name: start_server(net, name, tiny_llama_path, maddrs, "--blocks", blocks, "--host", "0.0.0.0",
                                      "--swarm-key", str(key), label=f"server-{name}", log=net_log, wait=False)
                   for name, blocks in (("a", "0:2"), ("b", "2:4"))}
        for proc in servers.values():
            wait_serving(proc)

        member = Agent(net, "client", tiny_llama_path, maddrs, swarm_key=str(key), log=net_log)
        assert member.ready["ready"], member.ready
        assert member.generate(reference.ids, reference.new_tokens) == reference.tokens

        # without the key, or with another one, the DHT answers nothing: joining it fails; and a stranger who knows
        # a server's address can connect, but the server reads nothing it sends (the three strangers at once)
        server_maddr = servers["a"].wait_for(r"serving blocks .* at (\S+)", 10).group(1)
        with ThreadPoolExecutor(3) as pool:
            joins = [pool.submit(Agent, net, "stranger", tiny_llama_path, maddrs, swarm_key=swarm_key, label=label,
                                 log=net_log) for label, swarm_key in (("no-key", None), ("other-key", str(other_key)))]
            dial = pool.submit(net.run, "stranger", [sys.executable, str(Path(__file__).with_name("stranger.py")),
                                                     server_maddr], timeout=180)
            for join in joins:
                stranger = join.result()
                assert not stranger.ready["ready"], stranger.ready
                assert "bootstrap failed" in stranger.ready["error"], stranger.ready
            done = dial.result()
        assert done.returncode == 0, done.stderr
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
        assert outcome["dialed"], outcome
        for what in ("info", "session"):
            assert "private swarm" in outcome[what] and "accepted" not in outcome[what], outcome
        servers["a"].wait_for("failed the membership challenge|did not answer the membership challenge", 10)

        # members still see no difference
        assert member.generate(reference.ids, reference.new_tokens) == reference.tokens


@pytest.mark.slow  # a long WAN scenario
def test_server_reachable_only_through_a_relay_serves_a_session(tiny_llama_path, reference, net_log):
    """Server n and the client accept no inbound connections (both behind NATs): the client reaches n only
    through a relay. The bundled p2pd reserves a relayed address at once only when it knows 4 relays."""
    hosts = {"relays": 0.005, "a": 0.010, "n": 0.0125, "client": 0.0075}
    with EmulatedNetwork(list(hosts), delays=hosts, private=["n", "client"]) as net:
        _, maddrs = start_dht(net, "relays", "--host", "0.0.0.0", "--relay", log=net_log)
        relays = [maddrs[0]]
        for i in range(3):
            _, extra = start_dht(net, "relays", "--host", "0.0.0.0", "--relay", "--initial-peers", ",".join(maddrs),
                                 label=f"relay-{i}", log=net_log)
            relays.append(extra[0])
        a = start_server(net, "a", tiny_llama_path, maddrs, "--blocks", "0:2", "--host", "0.0.0.0", label="server-a",
                         log=net_log, wait=False)
        n = start_server(net, "n", tiny_llama_path, maddrs, "--blocks", "2:4", "--host", "0.0.0.0",
                         "--relays", *relays, label="server-n", log=net_log, wait=False)
        wait_serving(a)
        n_peer = wait_serving(n)
        client = Agent(net, "client", tiny_llama_path, maddrs, log=net_log,
                       config={"update_period": 2.0, "unreachable_ban": 3.0, "missing_blocks_wait": 5.0})
        record = client.request("servers")["blocks"][3][n_peer]
        assert record["relayed"] and all("/p2p-circuit/p2p/" + n_peer in m for m in record["maddrs"]), record

        def generated():  # n becomes reachable once its relay reservation is made (~20 s after it starts)
            reply = client.request("generate", ids=reference.ids.tolist(), max_new_tokens=reference.new_tokens)
            return reply if reply["ok"] else None

        reply = wait_until(generated, timeout=240, interval=2.0)
        assert reply is not None, client.proc.tail()
        assert reply["tokens"] == reference.tokens
        assert [peer for peer, _, _ in client.request("route")["route"]][-1] == n_peer
