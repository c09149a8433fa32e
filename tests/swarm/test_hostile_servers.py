"""Servers on the route that lie (docs/security.md, "A server on your route"), each a real `corolla serve
--inject-fault MODE` armed by SIGUSR1: none of them gets an honest server distrusted, and greedy output stays HF's.

- corrupt-push: it answers the client honestly but pushes corrupted outputs on; its own signed receipt convicts it
  (push accountability needs no spot checks), never the honest server it pushed to.
- lie-to-checkers: it lies only when it checks another server; with only two holders of the span, the client
  computes the disputed span itself and convicts the liar; without that, nobody is convicted and the session says
  its output is unverified.
- false-quant: a float32 server announcing nf4 (whose honest error is large) to hide a bias: it is checked in its
  claimed kind, within that kind's tight tolerance, and convicted.
- nan: its NaN answers ban it and the step goes to a replica; the honest next server is never blamed.
"""

from __future__ import annotations

import signal

import pytest
import torch
from transformers import LlamaForCausalLM

from test_failover import BACKUP, PREFERRED, PROMPT, ActAfter, client  # noqa: F401 (fixture)
from test_verification import NEW_TOKENS, client_cache, expected  # noqa: F401 (fixtures: HF's tokens, the cache dir)

THREE = {"first": "0:1", "middle": "1:3", "last": "3:4"}


def run(model, streamer=None):
    """Greedy tokens in one session: (them, the peers it ended on, distrusted peers, banned peers, unverified, checks)."""
    with model.inference_session(max_length=64) as session:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session, streamer=streamer)
        manager = session.manager
        return (out, [s.peer_id for s in session.route], set(manager.distrusted), manager.banned(),
                session.unverified, model.reputation())


def arm(swarm, name: str) -> None:
    swarm.procs[name].popen.send_signal(signal.SIGUSR1)


def test_a_server_pushing_corrupt_outputs_is_convicted_by_its_own_receipt_and_the_next_server_is_not(start_swarm, expected):
    servers = {name: (blocks, []) for name, blocks in THREE.items()}
    servers["middle"] = (THREE["middle"], [*PREFERRED, "--inject-fault", "corrupt-push"])
    servers["replica"] = (THREE["middle"], BACKUP)
    swarm = start_swarm(**servers)
    with client(swarm) as model:  # no spot checks: receipts alone catch it
        out, peers, distrusted, _, unverified, _ = run(model, ActAfter(4, lambda: arm(swarm, "middle")))
    assert torch.equal(out, expected)
    assert distrusted == {swarm.peer_ids["middle"]}
    assert peers == [swarm.peer_ids[name] for name in ("first", "replica", "last")]
    assert not unverified


def test_with_spot_checks_a_corrupt_push_convicts_the_pusher_and_the_honest_receiver_passes_its_checks(start_swarm, expected):
    servers = {name: (blocks, []) for name, blocks in THREE.items()}
    servers["middle"] = (THREE["middle"], [*PREFERRED, "--inject-fault", "corrupt-push"])
    servers["replica"] = (THREE["middle"], BACKUP)
    servers["last-2"] = (THREE["last"], BACKUP)  # so the last server can be checked
    swarm = start_swarm(**servers)
    arm(swarm, "middle")
    with client(swarm, verify_rate=1.0, verify_seed=0) as model:
        out, _, distrusted, _, _, reputation = run(model)
    assert torch.equal(out, expected)
    assert distrusted == {swarm.peer_ids["middle"]}
    assert not reputation.get(swarm.peer_ids["last"], {}).get("distrusted")
    assert reputation[swarm.peer_ids["last"]]["failed"] == 0


@pytest.mark.parametrize("referee", [True, False])
def test_a_checker_that_lies_about_the_only_other_holder_is_convicted_by_the_clients_own_computation(
        start_swarm, expected, referee):
    swarm = start_swarm(head=("0:2", []), main=("2:4", PREFERRED), liar=("2:4", [*BACKUP, "--inject-fault", "lie-to-checkers"]))
    arm(swarm, "liar")
    with client(swarm, verify_rate=1.0, verify_seed=0, verify_referee=referee) as model:
        out, peers, distrusted, _, unverified, reputation = run(model)
    main, liar = swarm.peer_ids["main"], swarm.peer_ids["liar"]
    assert torch.equal(out, expected)
    assert peers == [swarm.peer_ids["head"], main]  # the honest server kept the route
    assert main not in distrusted and not reputation.get(main, {}).get("failed")
    if referee:
        assert distrusted == {liar} and not unverified
    else:  # one server's word against another's: nobody convicted, and the session says so
        assert distrusted == set() and unverified


def test_a_float32_server_announcing_nf4_to_hide_a_bias_is_checked_as_nf4_and_convicted(start_swarm, expected):
    swarm = start_swarm(head=("0:2", []), liar=("2:4", [*PREFERRED, "--inject-fault", "false-quant"]),
                        honest=("2:4", BACKUP))
    arm(swarm, "liar")
    with client(swarm, verify_rate=0.05, verify_seed=0) as model:
        out, peers, distrusted, _, unverified, _ = run(model)
    assert torch.equal(out, expected)
    assert distrusted == {swarm.peer_ids["liar"]}
    assert peers == [swarm.peer_ids["head"], swarm.peer_ids["honest"]]
    assert not unverified


def test_a_server_answering_nan_is_banned_and_its_replica_takes_over_with_nobody_else_blamed(start_swarm, expected):
    servers = {name: (blocks, []) for name, blocks in THREE.items()}
    servers["middle"] = (THREE["middle"], [*PREFERRED, "--inject-fault", "nan"])
    servers["replica"] = (THREE["middle"], BACKUP)
    swarm = start_swarm(**servers)
    with client(swarm) as model:
        out, peers, distrusted, banned, _, _ = run(model, ActAfter(4, lambda: arm(swarm, "middle")))
    assert torch.equal(out, expected)
    assert peers == [swarm.peer_ids[name] for name in ("first", "replica", "last")]
    assert swarm.peer_ids["middle"] in banned
    assert swarm.peer_ids["last"] not in banned | distrusted and swarm.peer_ids["first"] not in banned | distrusted


def test_a_corrupt_push_among_passes_in_flight_convicts_the_pusher_and_the_output_is_hf_greedy(
        start_swarm, expected, tiny_llama_path):
    """Pipelined speculation: the middle server starts corrupting its pushes while several passes are in flight;
    the first answer judged against its receipt fails the pipe, the pusher is distrusted and replaced, and the passes
    not answered are redone: nobody else is blamed and the tokens are HF's."""
    servers = {name: (blocks, []) for name, blocks in THREE.items()}
    servers["middle"] = (THREE["middle"], [*PREFERRED, "--inject-fault", "corrupt-push"])
    servers["replica"] = (THREE["middle"], BACKUP)
    servers["last"] = (THREE["last"], ["--inject-fault", "slow"])  # 0.1 s a step: the passes stay in flight
    swarm = start_swarm(**servers)
    arm(swarm, "last")
    drafter = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()  # every draft right
    with client(swarm) as model, model.inference_session(max_length=64) as session:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, session=session, assistant_model=drafter,
                             num_assistant_tokens=3, assistant_confidence_threshold=0.0, passes_in_flight=4,
                             streamer=ActAfter(4, lambda: arm(swarm, "middle")))
        peers = [s.peer_id for s in session.route]
        distrusted, banned = set(session.manager.distrusted), session.manager.banned()
        assert session.most_in_flight >= 3
    assert torch.equal(out, expected)
    assert distrusted == {swarm.peer_ids["middle"]}
    assert peers == [swarm.peer_ids[name] for name in ("first", "replica", "last")]
    assert not {swarm.peer_ids["first"], swarm.peer_ids["last"]} & set(banned)
