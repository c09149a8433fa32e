"""Server-to-server push against real servers: greedy output equal to HF in push and relay mode, a server killed or
failing at each position of a 3-server route (first, middle, last) changes nothing in the output, and a peer the
session's owner did not name cannot push steps into the session (refused with a clear error, the server lives on)."""

from __future__ import annotations

import signal

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import TestSwarm, start_named_servers
from corolla.client.event_loop import run_sync
from corolla.testing.push_attacks import push_directly, push_through_upstream
from test_failover import BACKUP, PREFERRED, PROMPT, ActAfter, client  # noqa: F401 (fixture)

THREE = {"first": "0:1", "middle": "1:3", "last": "3:4"}


@pytest.fixture(scope="module")
def three_servers(tiny_llama_path, tmp_path_factory):
    """The bare three-server route (THREE, no extra flags), one swarm for the module (see start_swarm below)."""
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        yield start_named_servers(local, tiny_llama_path, {name: ["--blocks", blocks] for name, blocks in THREE.items()})


@pytest.fixture
def start_swarm(start_swarm, request):
    """conftest's start_swarm, except that the bare three-server route, which the tests given it leave as they found
    it (nothing killed, no fault flag), is the module's one `three_servers`, checked clean after each such test."""
    shared = []

    def start(**servers):
        if servers == {name: (blocks, []) for name, blocks in THREE.items()}:
            shared.append(request.getfixturevalue("three_servers"))
            return shared[-1]
        return start_swarm(**servers)

    yield start
    for swarm in shared:
        swarm.assert_clean()


@pytest.fixture(scope="module")
def expected(tiny_llama_path) -> torch.Tensor:
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    return reference.generate(PROMPT, max_new_tokens=30, do_sample=False)


def generate(model, streamer=None) -> tuple[torch.Tensor, list[str], int, int, int]:
    """30 greedy tokens in one session: them, the peers the session ended on, its steps, its pushed steps and its
    exchanges (requests the client waited for)."""
    with model.inference_session(max_length=64) as session:
        out = model.generate(PROMPT, max_new_tokens=30, session=session, streamer=streamer)
        return out, [s.peer_id for s in session.route], session.steps, session.pushed_steps, session.exchanges


@pytest.mark.parametrize("push", [True, False])
def test_three_servers_give_hf_greedy_output_in_push_and_relay_mode(start_swarm, expected, push):
    swarm = start_swarm(**{name: (blocks, []) for name, blocks in THREE.items()})
    with client(swarm, push=push) as model:
        out, peers, steps, pushed, exchanges = generate(model)
    assert torch.equal(out, expected)
    assert peers == [swarm.peer_ids[name] for name in THREE]
    assert pushed == (steps if push else 0)
    assert exchanges == (steps if push else len(THREE) * steps)  # one request per step, or one per server


@pytest.mark.parametrize("position", [pytest.param("first", marks=pytest.mark.slow), "middle",
                                      pytest.param("last", marks=pytest.mark.slow)])  # the failover matrix: `slow`
def test_a_server_killed_at_each_position_of_a_push_route_keeps_greedy_output_identical(start_swarm, expected, position):
    servers = {name: (blocks, PREFERRED if name == position else []) for name, blocks in THREE.items()}
    servers["replica"] = (THREE[position], BACKUP)
    swarm = start_swarm(**servers)
    with client(swarm) as model:
        streamer = ActAfter(10, lambda: swarm.local.kill(swarm.procs[position], signal.SIGKILL))
        out, peers, steps, pushed, _ = generate(model, streamer)
    assert torch.equal(out, expected)
    assert peers == [swarm.peer_ids["replica" if name == position else name] for name in THREE]
    assert pushed >= steps - 2  # every step went by push but the one that met the dead server


@pytest.mark.parametrize("fault", [pytest.param("fail", marks=pytest.mark.slow), "drop"])  # test_failover: fail
def test_a_middle_server_that_fails_or_drops_a_pushed_step_is_routed_around(start_swarm, expected, fault):
    servers = {name: (blocks, [*PREFERRED, "--inject-fault", fault] if name == "middle" else []) for name, blocks in THREE.items()}
    servers["replica"] = (THREE["middle"], BACKUP)
    swarm = start_swarm(**servers)
    with client(swarm, request_timeout=3.0) as model:
        streamer = ActAfter(10, lambda: swarm.procs["middle"].popen.send_signal(signal.SIGUSR1))
        out, peers, _, _, _ = generate(model, streamer)
    assert torch.equal(out, expected)
    assert peers == [swarm.peer_ids[name] for name in ("first", "replica", "last")]


def test_a_peer_the_owner_did_not_name_cannot_push_into_a_session_even_with_the_links_secret(start_swarm, expected):
    swarm = start_swarm(**{name: (blocks, []) for name, blocks in THREE.items()})
    with client(swarm) as model:
        with model.inference_session(max_length=64) as session:
            first = model.generate(PROMPT[:, :3], max_new_tokens=2, session=session)
            spans = session.chain.spans
            # the client's own peer knows the secret of the link first -> middle, but is not the peer it named
            attempt = run_sync(push_directly(model.swarm_node, spans[1].span.peer_id, spans[0].secret,
                                             torch.zeros(1, 1, 64), position=0))
            assert attempt.answers[0].startswith("error: push refused: no open session here accepts pushes from")
            # the session (and the server) go on as if nothing happened
            out = model.generate(PROMPT, max_new_tokens=30, session=session)
    assert first.shape[1] == 5
    assert torch.equal(out, expected)
    assert swarm.procs["middle"].popen.poll() is None


def test_a_server_does_not_push_into_a_session_on_behalf_of_another_peer(start_swarm, expected):
    """The confused deputy: a peer that learned a victim's session opens its own session on the upstream server,
    names the victim's server as its push target and asks for a push. With a guessed secret the victim's server
    refuses the push; with the link's real secret (leaked) the upstream refuses to push over a link another of its
    sessions owns. Either way nothing of the victim's session is overwritten, rolled back or returned to the attacker."""
    swarm = start_swarm(**{name: (blocks, []) for name, blocks in THREE.items()})
    with client(swarm) as model, client(swarm) as attacker:
        with model.inference_session(max_length=64) as session:
            model.generate(PROMPT[:, :3], max_new_tokens=2, session=session)
            spans = session.chain.spans
            held = session.position
            for secret, position in [("0" * 32, 0), ("1" * 32, 2), (spans[0].secret, 0)]:
                attempt = run_sync(push_through_upstream(
                    attacker.swarm_node, spans[0].span.peer_id, (spans[0].span.start, spans[0].span.end),
                    spans[1].span.peer_id, secret, torch.randn(1, 3, 64), position=position))
                if secret == spans[0].secret:
                    assert attempt.answers == ("error: push refused: another session already pushes over this link",)
                else:  # opened, and its own step answered by the upstream: nothing of the victim's came back
                    assert attempt.answers[0] == "session_opened" and len(attempt.outputs) == 1, attempt.answers
            assert session.position == held
            out = model.generate(PROMPT, max_new_tokens=30, session=session)
    assert torch.equal(out, expected)
