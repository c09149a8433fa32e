"""client.swarm.links: failed push links and their common factors, exactly as its docstring's table says."""

from __future__ import annotations

from corolla.client.swarm.links import MAX_FAILED_LINKS, LinkRecord


def record(*links: tuple[str, str]) -> LinkRecord:
    links_record = LinkRecord()
    for pusher, receiver in links:
        links_record.record(pusher, receiver)
    return links_record


def test_one_failed_link_suspects_nobody_and_a_common_factor_is_suspected():
    assert record(("A", "B")).suspects() == set()
    assert record(("A", "B"), ("A", "C")).suspects() == {"A"}
    assert record(("B", "A"), ("A", "C")).suspects() == {"A"}  # either direction of the link counts


def test_the_same_partner_twice_is_one_partner():
    assert record(("A", "B"), ("A", "B"), ("B", "A")).suspects() == set()


def test_a_partner_that_failed_with_others_too_counts_against_nobody():
    assert record(("A", "B"), ("A", "C"), ("D", "C")).suspects() == set()


def test_a_lying_receiver_cannot_make_its_honest_pushers_suspects():
    liar = record(("H1", "L"), ("H2", "L"), ("H3", "L"))
    assert liar.suspects() == {"L"}


def test_old_failures_are_forgotten():
    links = record(("A", "B"), ("A", "C"))
    for i in range(MAX_FAILED_LINKS):
        links.record(f"x{i}", f"y{i}")
    assert "A" not in links.suspects()
