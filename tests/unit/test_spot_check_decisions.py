"""Spot checks' pure decisions (client.verification) and the reputation file (client.reputation)."""

from __future__ import annotations

import json

import pytest
import torch

from corolla.client.config import ClientConfig
from corolla.client.reputation import Reputation, load
from corolla.client.verification import (
    TOL_HALF, TOL_INT8, TOL_NF4, TOL_SAME_EXACT, TOL_SAME_LOW, checker_rank, decide, pair_tolerance, relative_error,
    rewind_position, sequence_rewind,
)
from corolla.protocol.messages import ServerInfo, ServerState
from corolla.server.faults import corrupted


def info(dtype: str = "float32", quant: str = "none") -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=4, throughput=1.0, cache_tokens_total=1000,
                      cache_tokens_free=1000, torch_dtype=dtype, quant=quant, version="0", protocol_version=1,
                      max_session_length=4096)


def test_relative_error_is_the_worst_position_relative_l2():
    ref = torch.ones(1, 3, 4)
    out = ref.clone()
    out[0, 1] *= 1.5
    assert relative_error(out, ref) == pytest.approx(0.5)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.full_like(ref, float("nan")), ref) == float("inf")
    assert relative_error(ref[:, :2], ref) == float("inf")


def test_corrupt_perturbation_is_above_the_same_kind_tolerance():
    torch.manual_seed(0)
    out = torch.randn(2, 8, 64)
    assert relative_error(corrupted(out), out) > 3 * TOL_SAME_EXACT


def test_pair_tolerance_is_tight_for_one_kind_and_the_looser_server_otherwise():
    assert pair_tolerance(info(), info()) == TOL_SAME_EXACT
    assert pair_tolerance(info("bfloat16"), info("bfloat16")) == TOL_SAME_LOW
    assert pair_tolerance(info(quant="nf4"), info(quant="nf4")) == TOL_SAME_LOW
    assert pair_tolerance(info(), info("bfloat16")) == TOL_HALF
    assert pair_tolerance(info("bfloat16"), info(quant="int8")) == TOL_INT8
    assert pair_tolerance(info(quant="nf4"), info()) == TOL_NF4
    assert pair_tolerance(None, info()) == TOL_NF4  # an unknown server: the loosest


def test_checker_is_chosen_among_the_servers_of_the_suspects_kind():
    candidates = [("bf", info("bfloat16")), ("f1", info()), ("q", info(quant="int8")), ("f2", info())]
    assert [peer for peer, _ in checker_rank(info(), candidates)] == ["f1", "f2"]
    assert [peer for peer, _ in checker_rank(info(quant="nf4"), candidates)] == ["bf", "f1", "q", "f2"]
    assert checker_rank(info(), []) == []


@pytest.mark.parametrize("errors, verdict", [
    ((1e-4, None, None), "agree"),
    ((1e-2, None, None), "ban_suspect"),  # no third opinion: the server the session used goes
    ((1e-2, 1e-2, 1e-5), "ban_suspect"),  # the third agrees with the checker
    ((1e-2, 1e-5, 1e-2), "ban_checker"),  # the third agrees with the suspect
    ((1e-2, 1e-2, 1e-2), "ban_both"),
    ((1e-2, 1e-4, 1e-4), "ban_suspect"),  # both within tolerance of the third: keep nothing doubtful in use
])
def test_tie_break_decisions(errors, verdict):
    suspect_checker, suspect_third, checker_third = errors
    assert decide(suspect_checker, 1e-3, suspect_third, 1e-3, checker_third, 1e-3) == verdict


def test_rewind_goes_to_the_first_output_of_the_liar_and_keeps_the_token_predicted_before_it():
    assert rewind_position(0) == 0
    assert rewind_position(17) == 17
    # session positions p: prefix 0, prompt 5 tokens, sequence 12 columns
    assert sequence_rewind(8, 0, 5, 12) == 9  # the token at position 8 came from position 7's honest output
    assert sequence_rewind(0, 0, 5, 12) == 5  # never drop the caller's prompt
    assert sequence_rewind(8, 3, 2, 12) == 6  # prompt-tuning prompts take positions [0, 3)
    assert sequence_rewind(20, 0, 5, 12) == 12


def test_reputation_counts_merge_into_one_file_across_clients(tmp_path):
    path = tmp_path / "reputation.json"
    first, second = Reputation(path), Reputation(path)
    first.passed("a")
    first.save()
    second.passed("a")
    second.failed("b", distrust=True)
    second.save()
    first.passed("a")
    first.save()
    records = load(path)
    assert (records["a"].passed, records["a"].failed) == (3, 0)
    assert records["b"].distrusted and records["b"].failed == 1
    assert second.distrusted() == {"b"} and first.distrusted() == set()  # a ban is the catching client's own
    assert set(json.loads(path.read_text())["peers"]) == {"a", "b"}


def test_verify_rate_is_off_by_default_and_checked():
    assert ClientConfig().verify_rate == 0.0
    with pytest.raises(ValueError):
        ClientConfig(verify_rate=1.5)
