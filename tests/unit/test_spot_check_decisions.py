"""Spot checks' pure decisions (client.trust.verification) and the reputation file (client.trust.reputation)."""

from __future__ import annotations

import json

import pytest
import torch

from corolla.client.config import ClientConfig
from corolla.client.trust.reputation import Reputation, load
from corolla.client.trust.verification import (
    TOL_HALF, TOL_INT8, TOL_NF4, TOL_SAME_EXACT, TOL_SAME_LOW, kind_of, opinion_tolerance, pair_tolerance, plan_checkers,
    referee_verdict, relative_error, rewind_position, sequence_rewind, third_opinion,
)
from corolla.protocol.messages import ComputeKind, QuantMode, ServerInfo, ServerState
from corolla.server.rpc.faults import FALSE_QUANT_SCALE, corrupted


def info(dtype: str = "float32", quant: str = "none", adapters: tuple[str, ...] = ()) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=4, throughput=1.0, cache_tokens_total=1000,
                      cache_tokens_free=1000, torch_dtype=dtype, quant=quant, version="0", protocol_version=1,
                      max_session_length=4096, adapters=adapters)


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
    assert pair_tolerance(info("float16"), info("bfloat16")) == TOL_HALF  # different kinds


def test_the_checker_computes_as_the_suspects_kind_a_server_of_it_first_then_a_float32_one_emulating_it():
    candidates = [("bf", info("bfloat16")), ("f1", info()), ("q", info(quant="int8")), ("f2", info()),
                  ("fa", info(adapters=("lora",)))]
    nf4 = ComputeKind(dtype="float32", quant=QuantMode.NF4)
    # a float32 suspect: the float32 servers, as themselves
    assert [[(p.peer_id, p.emulate) for p in tier] for tier in plan_checkers(info(), candidates)] == [
        [("f1", None), ("f2", None), ("fa", None)]]
    # an nf4 suspect: nobody is nf4, so float32 servers without adapters compute as nf4; its tolerance stays tight
    tiers = plan_checkers(info(quant="nf4"), candidates)
    assert [[(p.peer_id, p.emulate, p.kind) for p in tier] for tier in tiers] == [[("f1", nf4, nf4), ("f2", nf4, nf4)]]
    assert opinion_tolerance(kind_of(info(quant="nf4")), tiers[0][0].kind) == TOL_SAME_LOW
    # an int8 suspect with a server of its kind: that one first
    assert [p.peer_id for p in plan_checkers(info(quant="int8"), candidates)[0]] == ["q"]
    # emulation not possible for this request (deep prompts, an adapter): every server as itself, loosely
    loose = plan_checkers(info(quant="nf4"), candidates, emulation=False)
    assert [p.peer_id for p in loose[0]] == ["bf", "f1", "q", "f2", "fa"] and all(p.emulate is None for p in loose[0])
    assert plan_checkers(info(), []) == []


def test_a_false_quantization_claim_does_not_widen_the_tolerance():
    torch.manual_seed(0)
    honest = torch.randn(2, 8, 64)
    biased = corrupted(honest, FALSE_QUANT_SCALE)
    # the old rule: a float32 checker against a suspect announcing nf4 allowed nf4's error; the bias hid in it
    assert relative_error(biased, honest) < pair_tolerance(info(quant="nf4"), info())
    # like with like: the checker computes as nf4, and the tolerance is nf4's own
    nf4 = kind_of(info(quant="nf4"))
    assert relative_error(biased, honest) > opinion_tolerance(nf4, nf4)


@pytest.mark.parametrize("errors, verdict", [
    ((1e-2, 1e-5), "ban_suspect"),  # the third agrees with the checker only
    ((1e-5, 1e-2), "ban_checker"),  # the third agrees with the suspect only
    ((1e-2, 1e-2), "dispute"),  # with neither: it settles nothing
    ((1e-4, 1e-4), "dispute"),  # with both (they sit near the tolerance): nothing either
])
def test_a_third_opinion_convicts_only_when_it_agrees_with_exactly_one(errors, verdict):
    suspect_third, checker_third = errors
    assert third_opinion(suspect_third, 1e-3, checker_third, 1e-3) == verdict


@pytest.mark.parametrize("errors, verdict", [
    ((1e-5, 1e-5), "agree"), ((1e-5, 1e-2), "ban_checker"), ((1e-2, 1e-5), "ban_suspect"), ((1e-2, 1e-2), "ban_both"),
])
def test_the_clients_own_computation_convicts_whoever_disagrees_with_it(errors, verdict):
    assert referee_verdict(errors[0], 1e-3, errors[1], 1e-3) == verdict


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
    assert ClientConfig().verify_rate == 0.0 and ClientConfig().verify_referee
    with pytest.raises(ValueError):
        ClientConfig(verify_rate=1.5)
