"""Scenarios: defaults are the goals' swarm; bad ones get one clear line; files and flags combine."""

from __future__ import annotations

import json

import pytest

from corolla.sim.scenario import Scenario, from_mapping, load_file, validated


def test_the_defaults_are_the_goals_scenario():
    s = validated(Scenario())
    assert (s.servers, s.blocks, s.duration, s.churn, s.burst_fraction) == (1000, 80, 3600.0, 7200.0, 0.1)
    assert len(s.classes) == 3 and len(s.regions) == 4


@pytest.mark.parametrize("changes, says", [
    ({"servers": -1}, "servers must be >= 1"),
    ({"blocks": 4}, "16 blocks per server, but the model has 4"),
    ({"duration": 0}, "duration must be within"),
    ({"duration": float("inf")}, "duration must be within"),
    ({"warmup": 4000}, "warmup must be within"),
    ({"demand": -0.5}, "demand must be >= 0"),
    ({"demand": 0, "clients": 0}, "no load"),
    ({"prompt_min": 200, "prompt_max": 100}, "prompt_min <= prompt_max"),
    ({"burst_fraction": 1.5}, "burst_fraction must be within"),
    ({"burst_region": "mars"}, "not a region"),
    ({"policy": "greedy"}, "policy must be one of"),
    ({"placements": [[3, 99]]}, "outside the model's 80 blocks"),
    ({"rtt_ms": [[1.0]]}, "square matrix"),
    ({"clusters": 3}, "unknown key"),
    ({"classes": [{"name": "x", "share": 1.0, "speed": 1.0}]}, "bad scenario"),
])
def test_a_bad_scenario_is_refused_in_one_line(changes, says):
    with pytest.raises(ValueError, match=says) as raised:
        from_mapping(changes)
    assert "\n" not in str(raised.value) and str(raised.value).startswith("bad scenario")


def test_a_scenario_file_and_flags_over_it(tmp_path):
    path = tmp_path / "lan.json"
    path.write_text(json.dumps({
        "servers": 6, "blocks": 6, "clients": 8, "churn": 0,
        "classes": [{"name": "cpu", "share": 1.0, "speed": 1.0, "blocks": 2, "cache_tokens": 16384}],
        "regions": [{"name": "lan", "servers": 1.0, "clients": 1.0}], "rtt_ms": [[20]],
        "placements": [[0, 2], [2, 4], [4, 6]],
    }))
    base = from_mapping(load_file(path))
    assert base.classes[0].name == "cpu" and base.placements == ((0, 2), (2, 4), (4, 6))
    assert from_mapping({"seed": 7}, base).seed == 7 and from_mapping({"seed": 7}, base).clients == 8
    toml = tmp_path / "s.toml"
    toml.write_text('servers = 10\nblocks = 20\n')
    assert from_mapping(load_file(toml)).servers == 10
    (tmp_path / "bad.json").write_text("{servers: 1")
    with pytest.raises(ValueError, match="does not parse"):
        load_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_file(tmp_path / "missing.json")
