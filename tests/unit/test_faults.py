"""Fault injection wraps the server's compute (server.rpc.faults): nothing changes until it is armed; then each mode
misbehaves as `--inject-fault` promises."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from corolla.protocol.messages import ErrorCode
from corolla.server.rpc.faults import (CORRUPT_SCALE, FALSE_QUANT_SCALE, FAULT_MODES, FaultInjector, Hangup,
                                   announced_quant)
from corolla.server.compute.planner import Decode, Step
from corolla.server.errors import RequestError

STEP = Step(step_id=1, hidden=torch.ones(1, 1, 4), position=0)
PLAN = Decode((0, 1, None), 0)


class FakeCompute:
    """Answers every request with fixed outputs and counts the calls."""

    def __init__(self):
        self.calls: list[str] = []

    async def step(self, session, step, plan):
        self.calls.append("step")
        return torch.full((1, 1, 4), 2.0)

    async def forward(self, hidden, start, end, adapter, prompts, mask, kind=None):
        self.calls.append("forward")
        return torch.full((1, 3, 4), 3.0)

    async def backward(self, hidden, grad_output, start, end, adapter, prompts, mask):
        self.calls.append("backward")
        return torch.full((1, 3, 4), 4.0), None


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_until_armed_every_call_passes_through_unchanged(mode):
    inner = FakeCompute()
    faults = FaultInjector(inner, mode, stall_seconds=5.0)
    assert torch.equal(run(faults.step(None, STEP, PLAN)), torch.full((1, 1, 4), 2.0))
    assert torch.equal(run(faults.forward(torch.zeros(1, 3, 4), 0, 1, None, None, None)), torch.full((1, 3, 4), 3.0))
    assert torch.equal(run(faults.backward(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), 0, 1, None, None, None))[0],
                       torch.full((1, 3, 4), 4.0))
    assert inner.calls == ["step", "forward", "backward"]


def test_armed_fail_answers_an_internal_error_without_computing():
    inner = FakeCompute()
    faults = FaultInjector(inner, "fail", stall_seconds=5.0)
    faults.arm()
    with pytest.raises(RequestError) as error:
        run(faults.step(None, STEP, PLAN))
    assert error.value.code == ErrorCode.INTERNAL and inner.calls == []


def test_armed_drop_hangs_up():
    faults = FaultInjector(FakeCompute(), "drop", stall_seconds=5.0)
    faults.arm()
    with pytest.raises(Hangup):
        run(faults.step(None, STEP, PLAN))


def test_armed_stall_answers_a_timeout_after_the_stall():
    faults = FaultInjector(FakeCompute(), "stall", stall_seconds=0.2)
    faults.arm()
    begin = time.perf_counter()
    with pytest.raises(RequestError) as error:
        run(faults.step(None, STEP, PLAN))
    assert error.value.code == ErrorCode.TIMEOUT and time.perf_counter() - begin >= 0.2


def test_armed_corrupt_scales_half_the_features_of_step_and_forward_outputs_and_leaves_backward_alone():
    inner = FakeCompute()
    faults = FaultInjector(inner, "corrupt", stall_seconds=5.0)
    faults.arm()
    scale = torch.tensor([CORRUPT_SCALE, CORRUPT_SCALE, 1.0, 1.0])
    assert torch.equal(run(faults.step(None, STEP, PLAN)), torch.full((1, 1, 4), 2.0) * scale)
    assert torch.equal(run(faults.forward(torch.zeros(1, 3, 4), 0, 1, None, None, None)), torch.full((1, 3, 4), 3.0) * scale)
    grad, _ = run(faults.backward(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), 0, 1, None, None, None))
    assert torch.equal(grad, torch.full((1, 3, 4), 4.0)) and CORRUPT_SCALE == 1.01
    assert inner.calls == ["step", "forward", "backward"]


def test_armed_hostile_modes_lie_where_they_say_and_nowhere_else():
    scale = torch.tensor([CORRUPT_SCALE, CORRUPT_SCALE, 1.0, 1.0])
    x = torch.zeros(1, 3, 4)
    push = FaultInjector(FakeCompute(), "corrupt-push", stall_seconds=5.0)
    push.arm()
    assert torch.equal(run(push.step(None, STEP, PLAN)), torch.full((1, 1, 4), 2.0))  # the client gets the truth
    assert torch.equal(run(push.forward(x, 0, 1, None, None, None)), torch.full((1, 3, 4), 3.0))
    assert torch.equal(push.pushed(torch.full((1, 1, 4), 2.0)), torch.full((1, 1, 4), 2.0) * scale)  # the next server not
    checkers = FaultInjector(FakeCompute(), "lie-to-checkers", stall_seconds=5.0)
    checkers.arm()
    assert torch.equal(run(checkers.step(None, STEP, PLAN)), torch.full((1, 1, 4), 2.0))
    assert torch.equal(run(checkers.forward(x, 0, 1, None, None, None)), torch.full((1, 3, 4), 3.0) * scale)
    nan = FaultInjector(FakeCompute(), "nan", stall_seconds=5.0)
    nan.arm()
    assert torch.isnan(run(nan.step(None, STEP, PLAN))).all()
    false_quant = FaultInjector(FakeCompute(), "false-quant", stall_seconds=5.0)
    assert announced_quant("false-quant", "none") == "nf4" and announced_quant("corrupt", "int8") == "int8"
    assert torch.equal(run(false_quant.step(None, STEP, PLAN)), torch.full((1, 1, 4), 2.0))  # honest until armed
    false_quant.arm()
    biased = torch.tensor([FALSE_QUANT_SCALE, FALSE_QUANT_SCALE, 1.0, 1.0]) * 2.0
    assert torch.allclose(run(false_quant.step(None, STEP, PLAN)), biased.expand(1, 1, 4))


def test_unknown_fault_modes_are_refused():
    with pytest.raises(ValueError, match="fail, drop, stall, corrupt"):
        FaultInjector(FakeCompute(), "explode", stall_seconds=1.0)
