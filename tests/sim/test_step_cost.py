"""The measured step-cost table and the batch curve the fluid model inverts."""

from __future__ import annotations

import numpy as np
import pytest

from corolla.sim.step_cost import DECODE_SECONDS, MEASURED, BatchCurve, StepCost


def test_the_table_is_read_as_measured_and_scaled_by_speed():
    assert MEASURED.decode_seconds(1) == DECODE_SECONDS[0]
    assert MEASURED.decode_seconds(16, speed=2.0) == pytest.approx(0.01869 / 2)
    assert MEASURED.decode_seconds(12) == pytest.approx((0.01134 + 0.01869) / 2)  # linear between 8 and 16
    assert MEASURED.decode_seconds(0.3) == DECODE_SECONDS[0]  # below one session: one session's step
    assert MEASURED.decode_seconds(80) == pytest.approx(0.07378 + 16 * (0.07378 - 0.05417) / 16)  # extrapolated
    assert MEASURED.prefill_seconds(4) == MEASURED.prefill_seconds(16)  # short prompts cost the shortest measured


def test_the_best_rate_is_the_most_efficient_batch_within_the_cap():
    assert MEASURED.best_rate(1) == pytest.approx(1 / 0.00325)
    assert MEASURED.best_rate(64) == pytest.approx(48 / 0.05417)  # batch 48 beats 64 per token
    assert MEASURED.best_rate(64, speed=0.5) == pytest.approx(MEASURED.best_rate(64) / 2)


def test_the_batch_curve_inverts_the_running_maximum_of_the_rate():
    curve = BatchCurve(MEASURED, 64)
    assert curve.peak == pytest.approx(MEASURED.best_rate(64))
    batches = curve.batch_for(np.array([0.0, 1 / 0.00325, 16 / 0.01869, 1e9]))
    assert batches[0] == 1.0 and batches[1] == 1.0
    assert batches[2] == pytest.approx(16.0, abs=0.2)  # the first batch reaching that rate
    assert batches[3] == 48.0  # beyond the peak: the peak's batch (the server queues)
    assert np.all(np.diff(curve.rates) > 0)


def test_a_bad_table_is_refused():
    with pytest.raises(ValueError, match="decode table"):
        StepCost(((2, 0.1), (1, 0.2)), ((16, 0.1),))
    with pytest.raises(ValueError, match="prefill table"):
        StepCost(((1, 0.1),), ((16, -1.0),))
