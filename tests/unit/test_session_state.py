"""The session's bookkeeping and its rule for a `generate` call's ids, on plain token lists (exact outcomes).

The sessions here are built the way generate builds them: a call's ids are taken, sent, and the generated tokens
appended (each sent except the last). BOS is 1."""

from __future__ import annotations

import pytest
import torch

from corolla.client.session.session_state import CallReading, SessionState

BOS = (1,)


def after_turn(inputs: list[int], generated: list[int], prefix: int = 0) -> SessionState:
    """A session after one `generate(inputs)` call that produced `generated` (the last one not sent)."""
    state = SessionState(batch_size=1, prefix_length=prefix)
    state.take_call(torch.tensor([inputs]), leading=BOS)
    state.advance(prefix + len(inputs), None)
    for token in generated:
        state.append(torch.tensor([[token]]))
    state.advance(len(generated) - 1, None)
    return state


def read(state: SessionState, ids: list[int]) -> CallReading:
    return state.read_call(torch.tensor([ids]), leading=BOS)


def test_an_empty_session_takes_the_call_as_its_whole_context():
    state = SessionState(batch_size=1)
    assert read(state, [1, 5, 6]) == CallReading("fresh", 0, 0)
    state.take_call(torch.tensor([[1, 5, 6]]), leading=BOS)
    assert state.ids.tolist() == [[1, 5, 6]] and state.position == 0 and state.pending()[0].tolist() == [[1, 5, 6]]


def test_the_conversation_extending_the_session_sends_only_the_rest():
    state = after_turn([1, 5, 6], [7, 8, 9])  # holds 1 5 6 7 8 sent, 9 pending
    assert (state.position, state.reply_start) == (5, 3)
    assert read(state, [1, 5, 6, 7, 8, 9, 20, 21]) == CallReading("extend", 6, 0)
    state.take_call(torch.tensor([[1, 5, 6, 7, 8, 9, 20, 21]]), leading=BOS)
    assert state.position == 5 and state.pending()[0].tolist() == [[9, 20, 21]]
    assert state.reply_start == 8


def test_the_same_conversation_again_resends_its_last_token():
    state = after_turn([1, 5, 6], [7, 8, 9])
    state.advance(1, None)  # the pending 9 sent too: nothing is pending
    assert read(state, [1, 5, 6, 7, 8, 9]) == CallReading("extend", 6, 0)
    state.take_call(torch.tensor([[1, 5, 6, 7, 8, 9]]), leading=BOS)
    assert state.position == 5 and state.pending()[0].tolist() == [[9]]


def test_a_re_tokenized_reply_rolls_back_to_the_common_prefix():
    state = after_turn([1, 5, 6], [7, 8, 9])
    assert read(state, [1, 5, 6, 7, 30, 20]) == CallReading("rollback", 4, 0)  # 8 9 re-tokenized as 30
    state.take_call(torch.tensor([[1, 5, 6, 7, 30, 20]]), leading=BOS)
    assert state.position == 4 and state.ids.tolist() == [[1, 5, 6, 7, 30, 20]]
    assert state.pending()[0].tolist() == [[30, 20]]


def test_the_last_input_token_may_merge_with_the_reply():
    state = after_turn([1, 5, 6], [7, 8, 9])
    assert read(state, [1, 5, 31, 20]) == CallReading("rollback", 2, 0)  # "6" + "7" re-tokenized as 31
    assert read(state, [1, 32, 20]) == CallReading("new", 6, 6)  # only BOS in common


def test_the_whole_reply_re_tokenized_is_still_the_conversation():
    state = after_turn([1, 5, 6, 7], [8, 9, 10, 11])
    assert read(state, [1, 5, 6, 7, 40, 41, 42]) == CallReading("rollback", 4, 0)


def test_a_prefix_of_the_conversation_rolls_back_and_regenerates_from_it():
    state = after_turn([1, 5, 6], [7, 8, 9])
    assert read(state, [1, 5, 6]) == CallReading("rollback", 3, 0)
    state.take_call(torch.tensor([[1, 5, 6]]), leading=BOS)
    assert state.position == 2 and state.pending()[0].tolist() == [[6]]


@pytest.mark.parametrize("ids", [[20, 21], [20], [1], [1, 20, 21], [1, 5, 20], [5, 6, 7]])
def test_new_tokens_are_appended(ids):
    state = after_turn([1, 5, 6, 7], [8, 9])
    assert read(state, ids) == CallReading("new", 6, 6)
    state.take_call(torch.tensor([ids]), leading=BOS)
    assert state.ids.tolist() == [[1, 5, 6, 7, 8, 9, *ids]] and state.position == 5
    assert state.pending()[0].tolist() == [[9, *ids]]


def test_new_tokens_repeating_all_but_the_last_input_token_read_as_the_conversation():
    state = after_turn([1, 5, 6, 7], [8, 9])
    assert read(state, [1, 5, 6, 20]) == CallReading("rollback", 3, 0)


def test_in_a_short_session_new_tokens_that_repeat_the_input_read_as_the_conversation():
    """The documented ambiguity: after [BOS, 5] the new turn [BOS, 5, 6] is taken as the conversation."""
    state = after_turn([1, 5], [7, 8])
    assert read(state, [1, 5, 6]) == CallReading("rollback", 2, 0)
    assert read(state, [5, 6]) == CallReading("new", 4, 4)  # without BOS: new tokens


def test_without_leading_ids_one_shared_token_counts():
    state = after_turn([5, 6], [7, 8])
    assert state.read_call(torch.tensor([[5, 6, 7, 8, 9]])) == CallReading("extend", 4, 0)
    assert state.read_call(torch.tensor([[5, 40]])) == CallReading("rollback", 1, 0)
    assert state.read_call(torch.tensor([[40, 5]])) == CallReading("new", 4, 4)


def test_a_session_holding_only_bos_takes_a_bos_led_call_as_new_tokens():
    state = after_turn([1], [7])  # holds 1 sent, 7 pending
    assert read(state, [1, 7, 9]) == CallReading("extend", 2, 0)
    state = SessionState(batch_size=1)
    state.take_call(torch.tensor([[1]]), leading=BOS)
    assert read(state, [1, 9]) == CallReading("new", 1, 1)


def test_tokens_known_only_as_hidden_states_never_match():
    state = SessionState(batch_size=1)
    state.advance(3, None)  # a raw step of hidden states
    assert state.ids.tolist() == [[-1, -1, -1]] and state.reply_start == 3
    assert state.read_call(torch.tensor([[-1, -1, -1, 4]])) == CallReading("new", 3, 3)


def test_rows_are_compared_column_by_column_padding_by_mask():
    state = SessionState(batch_size=2)
    ids, mask = torch.tensor([[0, 1, 5], [1, 7, 8]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    state.take_call(ids, mask, leading=BOS)
    state.advance(3, mask)
    state.append(torch.tensor([[6], [9]]))
    assert state.reply_start == 3
    longer = torch.tensor([[99, 1, 5, 6, 2], [1, 7, 8, 9, 3]])  # the pad slot holds another id: still padding
    longer_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert state.read_call(longer, longer_mask, BOS) == CallReading("extend", 4, 0)
    repadded = torch.tensor([[0, 0, 1, 5, 6], [1, 7, 8, 9, 3]])
    assert state.read_call(repadded, torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), BOS).kind == "new"
    one_row_differs = torch.tensor([[0, 1, 5, 6], [1, 7, 8, 40]])
    assert state.read_call(one_row_differs, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), BOS) == CallReading("rollback", 3, 0)


def test_a_padded_row_needs_a_shared_token_past_its_padding_and_bos():
    state = SessionState(batch_size=2)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    state.take_call(torch.tensor([[0, 0, 1, 5], [1, 7, 8, 9]]), mask, leading=BOS)
    state.advance(4, mask)
    assert state.read_call(torch.tensor([[0, 0, 1, 6], [1, 7, 8, 9]]), mask, BOS).kind == "new"


def test_prompt_tuning_positions_come_before_the_tokens():
    state = after_turn([1, 5, 6], [7, 8], prefix=4)
    assert state.position == 4 + 4 and state.ids.tolist() == [[1, 5, 6, 7, 8]]
    state.take_call(torch.tensor([[1, 5, 6, 40]]), leading=BOS)
    assert state.position == 4 + 3 and state.pending()[0].tolist() == [[40]]
    state.rollback(2)  # into the prompts: no token left
    assert state.ids.shape == (1, 0) and state.sent == 0


def test_a_step_records_its_mask_and_the_prompts_count_as_real():
    state = SessionState(batch_size=2, prefix_length=2)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])  # 2 prompt positions, then 2 tokens
    assert state.step_mask(4, mask).tolist() == mask.bool().tolist()
    state.advance(4, mask)
    assert state.ids.tolist() == [[-1, -1], [-1, -1]] and state.mask.tolist() == [[False, True], [True, True]]
    assert state.positions_mask(4).tolist() == mask.bool().tolist()
    assert state.step_mask(1, None).tolist() == [[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]


def test_a_reorder_moves_ids_and_mask_now_and_replays_the_old_rows():
    state = SessionState(batch_size=2)
    mask = torch.tensor([[0, 1], [1, 1]])
    state.take_call(torch.tensor([[0, 5], [6, 7]]), mask)
    state.advance(2, mask)
    state.reorder([1, 1])
    state.reorder([1, 0])  # composes: row 0 <- old 1, row 1 <- old 1
    assert state.hypo_ids == [1, 1] and state.ids.tolist() == [[6, 7], [6, 7]]
    assert state.positions_mask(2) is None
    assert state.replay_mask(2).tolist() == [[False, True], [True, True]]  # the servers' rows, not reordered yet
    state.advance(1, None)
    assert state.hypo_ids is None and state.replay_mask(3) is None


def test_continuing_with_no_new_tokens_resends_the_last_one():
    state = after_turn([1, 5, 6], [7, 8])
    state.rollback(3)  # keeps 1 5 6, all sent
    state.take_call(torch.empty(1, 0, dtype=torch.long), leading=BOS)
    assert state.position == 2 and state.pending()[0].tolist() == [[6]]


def test_an_empty_context_is_refused_and_rollback_only_goes_back():
    state = SessionState(batch_size=1)
    with pytest.raises(ValueError, match="at least one input token"):
        state.take_call(torch.empty(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="roll a session back"):
        after_turn([1, 5], [6]).rollback(5)
    with pytest.raises(ValueError, match="hypo_ids"):
        after_turn([1, 5], [6]).reorder([1])
