"""The model index read as one entry per announcing server (dht.model_index.aggregate_models): exact models, claims,
order and bounds for honest, malformed and flooding entries."""

from __future__ import annotations

import time

from corolla.dht.model_index import (MAX_ANNOUNCERS, MAX_CLAIMS, MAX_INDEXED_MODELS, IndexedModel, IndexEntry,
                                     aggregate_models)


def entry(prefix: str, num_blocks: int, model_type: str = "llama") -> dict:
    return IndexEntry(prefix=prefix, num_blocks=num_blocks, model_type=model_type).model_dump(mode="json")


def test_servers_of_one_model_make_one_model_with_the_count_most_of_them_announce():
    entries = {"p1": entry("llama-7b", 32), "p2": entry("llama-7b", 32), "p3": entry("llama-7b", 40),
               "p4": entry("bloom", 70, "bloom")}
    models = aggregate_models(entries)
    assert list(models) == ["llama-7b", "bloom"]
    llama = models["llama-7b"]
    assert (llama.num_blocks, llama.model_type, llama.servers) == (32, "llama", 3)
    assert sorted(llama.announcers) == ["p1", "p2"]
    assert [(c.num_blocks, c.servers, sorted(c.announcers)) for c in llama.claims] == [(32, 2, ["p1", "p2"]),
                                                                                       (40, 1, ["p3"])]
    bloom = models["bloom"]
    assert (bloom.num_blocks, bloom.model_type, bloom.servers, bloom.announcers) == (70, "bloom", 1, ("p4",))


def test_a_tie_between_claims_goes_to_the_fewer_blocks():
    assert aggregate_models({"p1": entry("m", 4096), "p2": entry("m", 6)})["m"].num_blocks == 6


def test_malformed_entries_are_skipped():
    entries = {"p1": entry("m", 6), "p2": {"prefix": "x", "num_blocks": 10**9}, "p3": "garbage", "p4": None,
               "p5": {"prefix": "", "num_blocks": 3}, "p6": {**entry("y", 3), "extra": 1}}
    models = aggregate_models(entries)
    assert list(models) == ["m"] and isinstance(models["m"], IndexedModel)
    assert (models["m"].num_blocks, models["m"].servers, models["m"].announcers) == (6, 1, ("p1",))


def test_preferred_then_most_announced_models_come_first_and_at_most_max_models_are_kept():
    entries = {f"fake{i}": entry(f"fake-{i}", 4096) for i in range(MAX_INDEXED_MODELS + 100)}
    entries |= {"a": entry("real", 6), "b": entry("real", 6), "c": entry("seen", 8)}
    models = aggregate_models(entries, prefer={"seen"}, salt=b"s")
    assert len(models) == MAX_INDEXED_MODELS
    assert list(models)[:2] == ["seen", "real"]
    assert aggregate_models({f"p{i}": entry("m", 6) for i in range(50)})["m"].servers == 50
    assert len(aggregate_models({f"p{i}": entry("m", 6) for i in range(50)})["m"].announcers) == MAX_ANNOUNCERS


def test_ties_are_drawn_in_an_order_that_changes_with_the_salt():
    entries = {f"p{i}": entry(f"model-{i}", 4) for i in range(200)}
    first = list(aggregate_models(entries, salt=b"1", max_models=8))
    second = list(aggregate_models(entries, salt=b"2", max_models=8))
    assert first != second and first == list(aggregate_models(entries, salt=b"1", max_models=8))
    drawn = set()
    for salt in range(40):  # a model outside the first 8 now is drawn at a later read
        drawn |= set(aggregate_models(entries, salt=str(salt).encode(), max_models=8))
    assert len(drawn) > 100


def test_ten_thousand_entries_cost_a_bounded_small_amount_of_work():
    entries = {f"12D3KooW{i:08d}": entry(f"fake-{i}", 4096) for i in range(10_000)} | {"me": entry("real", 6)}
    begin = time.perf_counter()
    models = aggregate_models(entries, prefer={"real"})
    assert time.perf_counter() - begin < 5.0  # ~0.1 s here; generous for a loaded machine
    assert len(models) == MAX_INDEXED_MODELS and next(iter(models)) == "real"


def test_supported_entries_outweigh_any_number_of_entries_only_one_node_answers_with():
    """Attack 4: 255 entries claiming the real model's prefix with 4,096 blocks, answered by one hostile node (support
    1), against 2 real servers' entries stored on the nodes near the key (support 3): the real claim is the model's
    record; the fake one is kept as a claim, for a reader that pings to judge."""
    entries = {f"sybil{i}": entry("tiny-llama", 4096) for i in range(255)} | {"a": entry("tiny-llama", 4),
                                                                               "b": entry("tiny-llama", 4)}
    support = {"a": 3, "b": 2}
    model = aggregate_models(entries, support=support)["tiny-llama"]
    assert (model.num_blocks, model.servers, sorted(model.announcers)) == (4, 257, ["a", "b"])
    assert [(c.num_blocks, c.servers, c.supported) for c in model.claims] == [(4, 2, 2), (4096, 255, 0)]
    assert aggregate_models(entries)["tiny-llama"].num_blocks == 4096  # without support: the count decides


def test_a_model_keeps_at_most_max_claims_and_supported_fakes_come_after_supported_real_models():
    entries = {f"p{i}": entry("m", 10 + i) for i in range(10)} | {"r": entry("real", 6)}
    entries |= {f"f{i}": entry(f"fake-{i}", 4096) for i in range(50)}
    models = aggregate_models(entries, support={"r": 2})
    assert len(models["m"].claims) == MAX_CLAIMS
    assert next(iter(models)) == "real"
