"""Throughput arithmetic and the on-disk measurement cache: exact values on plain data."""

from __future__ import annotations

import json

import torch

from corolla.server.presence import throughput
from corolla.server.presence.network import announced_throughput, network_tokens_per_second


def test_network_tokens_per_second_is_bandwidth_over_one_hidden_state():
    assert network_tokens_per_second(8192.0 * 100, hidden_size=2048, dtype=torch.float32) == 100.0
    assert network_tokens_per_second(4096.0 * 100, hidden_size=2048, dtype=torch.bfloat16) == 100.0


def test_announced_throughput_takes_the_network_once_per_span():
    assert announced_throughput(compute=20.0, network=None, num_blocks=4) == 20.0
    assert announced_throughput(compute=20.0, network=1000.0, num_blocks=4) == 20.0  # compute-bound
    # a span of 4 blocks at 20 tokens/s each needs 5 tokens/s through the span; a 2 tokens/s link caps it at 2,
    # i.e. 8 block-tokens/s: clients charge 4 / 8 = 0.5 s per token, the link's 1 / 2 s
    assert announced_throughput(compute=20.0, network=2.0, num_blocks=4) == 8.0


def test_cache_keeps_values_per_key_and_ages_them(tmp_path, monkeypatch):
    path = tmp_path / "throughput.json"
    calls = []
    assert throughput.cached_throughput({"a": 1}, lambda: calls.append(1) or 12.5, path=path) == 12.5
    assert throughput.cached_throughput({"a": 1}, lambda: calls.append(1) or 99.0, path=path) == 12.5
    assert calls == [1]  # measured once
    assert throughput.load_cached({"a": 2}, path=path) is None

    now = 1_000_000.0
    monkeypatch.setattr(throughput.time, "time", lambda: now)
    throughput.store_cached({"net": 1}, 5e6, path=path)
    assert throughput.load_cached({"net": 1}, max_age=60, path=path) == 5e6
    now += 61
    assert throughput.load_cached({"net": 1}, max_age=60, path=path) is None
    assert throughput.load_cached({"net": 1}, path=path) == 5e6  # no max_age: any age


def test_cache_reads_old_plain_numbers_and_survives_garbage(tmp_path):
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({throughput._key({"a": 1}): 7.0}))
    assert throughput.load_cached({"a": 1}, path=path) == 7.0
    assert throughput.load_cached({"a": 1}, max_age=10, path=path) is None  # no timestamp: too old to trust
    path.write_text("not json")
    assert throughput.load_cached({"a": 1}, path=path) is None
    throughput.store_cached({"a": 1}, 3.0, path=path)
    assert throughput.load_cached({"a": 1}, path=path) == 3.0
