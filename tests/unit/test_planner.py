"""The step planner: which way each checked inference step runs, exactly (server.compute.planner)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from corolla.server.compute.planner import (
    Chunked,
    Decode,
    Merged,
    Padded,
    PlanLimits,
    RowRun,
    Step,
    chunk_ranges,
    padded_plan,
    plan,
)

H = 4
LIMITS = PlanLimits(merge_max_tokens=8, max_chunk_tokens=6)


@dataclass
class FakeSession:
    start: int = 2
    end: int = 5
    adapter: str | None = None


def make_step(batch: int, length: int, position: int = 0, mask: list[list[int]] | None = None,
              prompt_length: int = 0) -> Step:
    return Step(
        step_id=1, hidden=torch.zeros(batch, length, H), position=position,
        mask=None if mask is None else torch.tensor(mask, dtype=torch.bool),
        prompts=torch.zeros(3, prompt_length, H) if prompt_length else None,
    )


def test_a_single_token_step_is_a_decode_step_keyed_by_blocks_and_adapter():
    assert plan(make_step(1, 1, position=5), FakeSession(), LIMITS) == Decode((2, 5, None), 5)
    assert plan(make_step(3, 1, position=0), FakeSession(0, 1, "lora"), LIMITS) == Decode((0, 1, "lora"), 0)


def test_a_padded_single_token_step_whose_token_is_real_in_every_row_decodes_at_each_rows_length():
    mask = [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]
    assert plan(make_step(3, 1, position=3, mask=mask), FakeSession(), LIMITS) == Decode((2, 5, None), (2, 3, 1))


def test_a_mask_without_padding_is_ignored():
    full = [[1, 1, 1], [1, 1, 1]]
    assert plan(make_step(2, 1, position=2, mask=full), FakeSession(), LIMITS) == Decode((2, 5, None), 2)
    assert plan(make_step(2, 3, position=0, mask=full), FakeSession(), LIMITS) == Merged(((0, 3),))


def test_a_single_token_step_with_deep_prompts_is_merged_not_batched():
    assert plan(make_step(1, 1, position=0, prompt_length=2), FakeSession(), LIMITS) == Merged(((0, 1),))


def test_steps_up_to_merge_max_tokens_are_merged_and_longer_ones_chunked():
    assert plan(make_step(2, 4), FakeSession(), LIMITS) == Merged(((0, 3), (3, 4)))  # 8 tokens: merged
    assert plan(make_step(3, 3), FakeSession(), LIMITS) == Chunked(((0, 2), (2, 3)))  # 9 tokens: block by block
    assert plan(make_step(1, 13, position=4), FakeSession(), LIMITS) == Chunked(((0, 6), (6, 12), (12, 13)))


def test_with_merge_max_tokens_1_only_decode_steps_merge():
    nf4 = PlanLimits(merge_max_tokens=1, max_chunk_tokens=2048)
    assert plan(make_step(1, 2), FakeSession(), nf4) == Chunked(((0, 2),))
    assert plan(make_step(1, 1, prompt_length=1), FakeSession(), nf4) == Merged(((0, 1),))


def test_padded_prefill_groups_rows_by_length_and_real_slots():
    mask = [[0, 0, 1, 1],   # row 0: slots 2, 3
            [0, 0, 1, 1],   # row 1: the same, runs with row 0
            [1, 1, 1, 1],   # row 2
            [0, 0, 0, 0],   # row 3: nothing real in this step, left out
            [0, 1, 1, 1]]
    expected = Padded((RowRun(0, 2, 0, (2, 3)), RowRun(2, 3, 0, (0, 1, 2, 3)), RowRun(4, 5, 0, (1, 2, 3))), ragged=False)
    assert plan(make_step(5, 4, mask=mask), FakeSession(), LIMITS) == expected


def test_padded_step_after_a_prefill_counts_each_rows_held_tokens():
    mask = [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]  # position 3: rows hold 2, 3, 2; two new slots
    expected = Padded((RowRun(0, 1, 2, (0,)), RowRun(1, 2, 3, (0, 1)), RowRun(2, 3, 2, (0, 1))), ragged=False)
    assert plan(make_step(3, 2, position=3, mask=mask), FakeSession(), LIMITS) == expected


def test_single_token_steps_with_a_padded_slot_and_rows_at_different_lengths_run_ragged():
    mask = [[1, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]]  # rows hold 2, 1, 1, 1; row 1's new slot is padding
    expected = Padded((RowRun(0, 1, 2, (0,)), RowRun(2, 4, 1, (0,))), ragged=True)
    assert plan(make_step(4, 1, position=2, mask=mask), FakeSession(), LIMITS) == expected


def test_rows_at_equal_lengths_with_one_padded_single_token_step_are_not_ragged():
    assert padded_plan(torch.tensor([[1, 1], [1, 0]], dtype=torch.bool), 1) == Padded((RowRun(0, 1, 1, (0,)),), False)


@pytest.mark.parametrize("batch, length, max_tokens, expected", [
    (1, 5, 2048, ((0, 5),)),
    (4, 5, 8, ((0, 2), (2, 4), (4, 5))),
    (16, 3, 8, ((0, 1), (1, 2), (2, 3))),  # a batch wider than the limit still moves one token at a time
    (1, 0, 8, ()),
])
def test_chunk_ranges(batch, length, max_tokens, expected):
    assert chunk_ranges(batch, length, max_tokens) == expected


def test_step_reports_its_shape_and_end():
    step = make_step(2, 3, position=4)
    assert (step.batch, step.length, step.end) == (2, 3, 7)
