"""Push mode's pure rules: the links the owner sets between the servers of a route, when a step is pushed, which
pushes a server accepts, and what a receipt proves (who is blamed for a pushed step's answer)."""

from __future__ import annotations

import pytest
import torch

from corolla.client.chain.push_audit import answer_problem, judge_receipt, judge_unsent
from corolla.client.chain.push_route import RouteHop, can_push, links_to_fix, wanted_links
from corolla.protocol.messages import PushSource, PushTarget
from corolla.protocol.receipts import sign_receipt, tensor_digest
from corolla.protocol.signing import PeerKey
from corolla.server.rpc.push import LiveSession, PushLinks, outgoing_push, push_receipt_problem
from corolla.server.errors import RequestError

SECRETS = {"A": "a" * 32, "B": "b" * 32, "C": "c" * 32}


def hop(peer: str, source: PushSource | None = None, target: PushTarget | None = None) -> RouteHop:
    return RouteHop(peer, SECRETS[peer], source, target)


def test_wanted_links_chain_each_server_to_the_next_over_its_own_secret():
    links = wanted_links([hop("A"), hop("B"), hop("C")])
    assert links == [
        (None, PushTarget(peer_id="B", secret=SECRETS["A"])),
        (PushSource(peer_id="A", secret=SECRETS["A"]), PushTarget(peer_id="C", secret=SECRETS["B"])),
        (PushSource(peer_id="B", secret=SECRETS["B"]), None),
    ]


def test_links_to_fix_names_only_the_servers_whose_links_changed():
    (_, a_target), (b_source, b_target), (c_source, _) = wanted_links([hop("A"), hop("B"), hop("C")])
    settled = [hop("A", None, a_target), hop("B", b_source, b_target), hop("C", c_source, None)]
    assert links_to_fix(settled) == []
    # C was replaced by a fresh session opened as a route of its own: B must push to it, it must accept B
    fresh = [*settled[:2], hop("C")]
    assert links_to_fix(fresh) == [(2, c_source, None)]
    # B replaced: A's target and C's source stay right only if B's replacement reuses nothing: both B and A change
    replaced = [hop("A", None, PushTarget(peer_id="Z", secret=SECRETS["A"])), hop("B"), settled[2]]
    assert [i for i, _, _ in links_to_fix(replaced)] == [0, 1]


def test_can_push_needs_push_on_two_spans_and_no_deep_prompts_to_send():
    assert can_push(2, True, 0, 0)
    assert not can_push(1, True, 0, 0)
    assert not can_push(3, False, 0, 0)
    assert not can_push(3, True, 4, 5)  # position 4 is still inside the deep prompts
    assert can_push(3, True, 5, 5)


def live() -> LiveSession:
    return LiveSession(session=object(), writer=object())  # type: ignore[arg-type]


def test_only_the_named_peer_presenting_the_links_secret_may_push():
    links, session = PushLinks(), live()
    links.set_source(session, PushSource(peer_id="A", secret=SECRETS["A"]))
    assert links.authorize("A", SECRETS["A"]) is session
    with pytest.raises(RequestError, match="no open session here accepts pushes from B"):
        links.authorize("B", SECRETS["A"])  # the right secret from another peer
    with pytest.raises(RequestError, match="no open session here accepts pushes from A"):
        links.authorize("A", SECRETS["B"])  # the right peer over another link (another client's session on A)
    assert links.accepting("A") == [session] and links.accepting("B") == []
    links.set_source(session, None)  # its owner names nobody: nobody may push
    with pytest.raises(RequestError):
        links.authorize("A", SECRETS["A"])


def test_a_second_session_cannot_take_over_an_existing_push_link():
    links, first, second = PushLinks(), live(), live()
    links.set_source(first, PushSource(peer_id="A", secret=SECRETS["A"]))
    with pytest.raises(RequestError, match="already uses this push link"):
        links.set_source(second, PushSource(peer_id="A", secret=SECRETS["A"]))
    links.drop(first)
    links.set_source(second, PushSource(peer_id="A", secret=SECRETS["A"]))
    assert links.authorize("A", SECRETS["A"]) is second


def test_only_one_session_may_push_over_a_link():
    links, victim, attacker = PushLinks(), live(), live()
    links.set_target(victim, PushTarget(peer_id="B", secret=SECRETS["A"]))
    with pytest.raises(RequestError, match="already pushes over this link"):
        links.set_target(attacker, PushTarget(peer_id="B", secret=SECRETS["A"]))
    links.set_target(attacker, PushTarget(peer_id="B", secret=SECRETS["B"]))  # its own link is fine
    links.drop(victim)
    links.set_target(attacker, PushTarget(peer_id="B", secret=SECRETS["A"]))


def test_a_push_carries_the_pushers_receipt_which_the_receiver_checks_against_what_arrived():
    key = PeerKey.generate()
    hidden, mask = torch.randn(1, 2, 8), torch.ones(1, 7, dtype=torch.bool)
    target = PushTarget(peer_id="B", secret=SECRETS["A"])
    message, tensors = outgoing_push(key, target, step_id=9, position=5, hypo_ids=None, push=True, hidden=hidden, mask=mask)
    assert message.secret == SECRETS["A"] and message.receipt.pusher == key.peer_id
    assert push_receipt_problem(message, tensors, pusher=key.peer_id, receiver="B") is None
    assert "digest" in push_receipt_problem(message, {**tensors, "hidden": hidden + 1}, pusher=key.peer_id, receiver="B")
    assert "does not describe" in push_receipt_problem(message, tensors, pusher="someone-else", receiver="B")
    assert "does not describe" in push_receipt_problem(message, tensors, pusher=key.peer_id, receiver="C")
    forged = message.model_copy(update={"receipt": message.receipt.model_copy(update={"position": 0}), "position": 0})
    assert "signature" in push_receipt_problem(forged, tensors, pusher=key.peer_id, receiver="B")


def judge(receipt, digest, **changes):
    expected = dict(pusher=receipt.pusher if receipt else "A", receiver="B", secret=SECRETS["A"], step_id=9,
                    position=5, hypo_ids=None, digest=digest)
    return judge_receipt(receipt, **{**expected, **changes})


def test_a_receipt_blames_the_receiver_unless_it_is_the_pushers_signature_of_this_step():
    key = PeerKey.generate()
    copy = torch.randn(1, 2, 8)
    digest = tensor_digest(copy, None)
    receipt = sign_receipt(key, "B", SECRETS["A"], 9, 5, None, True, digest)
    assert judge(receipt, digest) is None
    assert judge(None, digest).who == "receiver"
    assert judge(receipt, digest, secret=SECRETS["B"]).who == "receiver"  # a receipt of another session's link
    assert judge(receipt, digest, step_id=10).who == "receiver"  # an old receipt replayed
    assert judge(receipt, digest, receiver="C").who == "receiver"
    forged = receipt.model_copy(update={"digest": tensor_digest(copy + 1, None)})
    assert judge(forged, digest).who == "receiver"  # nobody but the pusher can sign another digest


def test_a_valid_receipt_of_other_tensors_or_another_position_convicts_the_pusher():
    key = PeerKey.generate()
    copy = torch.randn(1, 2, 8)
    honest = tensor_digest(copy, None)
    corrupt = sign_receipt(key, "B", SECRETS["A"], 9, 5, None, True, tensor_digest(copy * 1.01, None))
    assert judge(corrupt, honest).who == "pusher"
    rolled_back = sign_receipt(key, "B", SECRETS["A"], 9, 0, None, True, honest)
    assert judge(rolled_back, honest).who == "pusher"
    reordered = sign_receipt(key, "B", SECRETS["A"], 9, 5, [0], True, honest)
    assert judge(reordered, honest).who == "pusher"


def test_an_answer_must_have_the_steps_shape_be_finite_and_of_sane_size():
    x = torch.randn(2, 3, 8)
    assert answer_problem(x * 3, x) is None
    assert "shape" in answer_problem(x[:, :2], x)
    assert "NaN" in answer_problem(torch.full_like(x, float("nan")), x)
    assert "inf" in answer_problem(x.masked_fill(x > 1, float("inf")), x)
    assert "larger" in answer_problem(x * 1e6, x)
    assert "dtype" in answer_problem(torch.zeros(2, 3, 8, dtype=torch.int32), x)


def test_what_a_step_asks_of_the_last_server_is_part_of_the_receipt():
    key = PeerKey.generate()
    copy = torch.randn(1, 4, 8)
    digest = tensor_digest(copy, None)
    receipt = sign_receipt(key, "B", SECRETS["A"], 9, 5, None, True, digest, answer=1)
    assert judge(receipt, digest, answer=1) is None
    assert judge(receipt, digest).who == "pusher"  # it pushed "answer only the last position" where none was asked


def test_an_answer_of_the_last_positions_only_is_checked_against_those_positions():
    x = torch.randn(2, 5, 8)
    assert answer_problem(x[:, -1:] * 2, x, answer=1) is None
    assert "shape" in answer_problem(x * 2, x, answer=1)
    assert answer_problem(x[:, :0], x, answer=0) is None


def test_an_answer_to_a_step_the_client_never_sent_convicts_the_pusher_only_by_its_own_receipt_of_that_step():
    key = PeerKey.generate()
    digest = tensor_digest(torch.randn(1, 13, 8), None)
    rewrite = sign_receipt(key, "B", SECRETS["A"], 10, 0, None, True, digest)  # step 10: the client's last was 9
    common = dict(pusher=key.peer_id, receiver="B", secret=SECRETS["A"], step_id=10, expected=9)
    assert judge_unsent(rewrite, **common).who == "pusher"
    assert judge_unsent(None, **common).who == "receiver"  # no proof: the receiver answered a step nobody sent
    assert judge_unsent(rewrite, **{**common, "step_id": 11}).who == "receiver"  # another step's receipt
    assert judge_unsent(rewrite, **{**common, "secret": SECRETS["B"]}).who == "receiver"  # not over this link
    assert judge_unsent(rewrite, **{**common, "pusher": "someone-else"}).who == "receiver"
