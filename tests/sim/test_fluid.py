"""The fluid decode model: exact rates for one session, batching for many, a saturated server's queue."""

from __future__ import annotations

import pytest

from corolla.sim.fluid import Fluid
from corolla.sim.step_cost import MEASURED, BatchCurve


def make(servers: int = 1, speed: float = 1.0, span: int = 4, overhead: float = 0.002) -> Fluid:
    fluid = Fluid(BatchCurve(MEASURED, 64), overhead)
    for s in range(servers):
        fluid.set_server(s, speed, span)
    return fluid


def test_one_session_on_an_idle_server_decodes_at_its_single_step_speed():
    fluid = make()
    slot = fluid.add([(0, 4)], net=0.05, tokens=1, target=100, now=0.0)
    for _ in range(20):
        fluid.solve(1.0)
    # demand = rate x 4 blocks is below one session's rate: batch 1, a little waiting for its own earlier step
    step = 4 * MEASURED.decode_seconds(1)
    rate = fluid.rate[slot]
    busy = rate * 4 * MEASURED.decode_seconds(1)
    assert 1 / rate == pytest.approx(0.05 + step + 0.002 + 0.5 * busy * step, rel=1e-3)


def test_a_session_decodes_from_when_it_started_and_stops_at_its_target():
    fluid = make()
    slot = fluid.add([(0, 4)], net=0.0, tokens=1, target=5, now=9.5)
    fluid.rate[slot] = 4.0
    tokens, finished, at = fluid.advance(10.0, 1.0)
    assert tokens == pytest.approx(2.0) and list(finished) == []
    tokens, finished, at = fluid.advance(11.0, 1.0)
    assert tokens == pytest.approx(2.0) and list(finished) == [slot] and at[0] == pytest.approx(10.5)
    assert fluid.remove(slot) == 5.0


def test_sessions_batch_on_a_shared_server_and_a_saturated_one_serves_its_peak():
    fluid = make(span=1)
    slots = [fluid.add([(0, 1)], net=0.0, tokens=1, target=1e9, now=0.0) for _ in range(200)]
    for _ in range(60):
        fluid.solve(1.0)
    total = float(fluid.rate[slots].sum())
    assert fluid.batch[0] == 48.0  # the most efficient batch, the server is the bottleneck
    assert total == pytest.approx(fluid.curve.peak, rel=0.05)


def test_a_faster_server_steps_faster():
    slow, fast = make(speed=1.0), make(speed=2.0)
    a = slow.add([(0, 4)], net=0.0, tokens=1, target=10, now=0.0)
    b = fast.add([(0, 4)], net=0.0, tokens=1, target=10, now=0.0)
    slow.solve(1.0), fast.solve(1.0)
    assert fast.rate[b] > slow.rate[a] and fast.per_block[0] < slow.per_block[0]


def test_rows_left_by_stopped_sessions_are_compacted_without_changing_any_rate():
    churned, fresh = make(servers=3), make(servers=3)
    routes = [[(i % 3, 1 + i % 4), ((i + 1) % 3, 2)] for i in range(3000)]
    slots = [churned.add(route, net=0.01, tokens=1, target=1e9, now=0.0) for route in routes]
    for slot in slots[:2900]:  # most stop: the next rows appended compact the matrix
        churned.remove(slot)
    kept = slots[2900:] + [churned.add(route, net=0.01, tokens=1, target=1e9, now=0.0) for route in routes[:1500]]
    assert churned.rows < 2900 + 1500  # compacted
    reference = [fresh.add(route, net=0.01, tokens=1, target=1e9, now=0.0) for route in routes[2900:] + routes[:1500]]
    for _ in range(5):
        churned.solve(1.0), fresh.solve(1.0)
    assert churned.rate[kept] == pytest.approx(fresh.rate[reference], rel=1e-12)
    assert churned.demand[:3] == pytest.approx(fresh.demand[:3], rel=1e-12)
