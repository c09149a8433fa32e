"""Push mode's pure rules: the route a step carries, who each server must accept pushes from, when a step is
pushed, and which pushes a server accepts."""

from __future__ import annotations

import pytest

from corolla.client.push_route import RouteHop, can_push, push_route, sources_to_fix
from corolla.protocol.messages import PushHop, PushStep
from corolla.server.push import LiveSession, authorize_push, next_push
from corolla.server.validation import RequestError


def hops() -> list[RouteHop]:
    return [RouteHop("A", "sa", 3, None), RouteHop("B", "sb", 5, "A"), RouteHop("C", "sc", 7, "X")]


def test_push_route_names_every_later_hop_in_order():
    assert push_route(hops()) == (PushHop(peer_id="B", session_id="sb", step_id=5),
                                  PushHop(peer_id="C", session_id="sc", step_id=7))
    assert push_route(hops()[:1]) == ()


def test_sources_to_fix_names_each_server_whose_predecessor_changed():
    assert sources_to_fix(hops()) == [(2, "B")]
    assert sources_to_fix([RouteHop("A", "sa", 1, None), RouteHop("B", "sb", 1, None)]) == [(1, "A")]
    assert sources_to_fix([RouteHop("A", "sa", 1, "Z")]) == []  # the first server takes steps from the client only


def test_can_push_needs_push_on_two_spans_and_no_deep_prompts_to_send():
    assert can_push(2, True, 0, 0)
    assert not can_push(1, True, 0, 0)
    assert not can_push(3, False, 0, 0)
    assert not can_push(3, True, 4, 5)  # position 4 is still inside the deep prompts
    assert can_push(3, True, 5, 5)


def test_next_push_carries_the_step_and_the_rest_of_the_route():
    route = (PushHop(peer_id="B", session_id="sb", step_id=5), PushHop(peer_id="C", session_id="sc", step_id=7))
    peer, message = next_push(route, 12, [1, 0])
    assert peer == "B"
    assert message == PushStep(session_id="sb", step_id=5, position=12, hypo_ids=[1, 0], push_to=route[1:])
    assert next_push((), 12, None) is None


def live(push_from: str | None) -> LiveSession:
    return LiveSession(session=object(), writer=object(), push_from=push_from)  # type: ignore[arg-type]


def test_only_the_named_predecessor_may_push():
    session = live("A")
    assert authorize_push(session, "s1", "A") is session
    with pytest.raises(RequestError, match="did not name peer B"):
        authorize_push(session, "s1", "B")
    with pytest.raises(RequestError, match="did not name peer A"):
        authorize_push(live(None), "s1", "A")  # nobody named: nobody may push
    with pytest.raises(RequestError, match="no open session s2"):
        authorize_push(None, "s2", "A")
