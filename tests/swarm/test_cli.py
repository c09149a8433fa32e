"""The command line per the public contract: every command answers --help; dht, status and generate work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from corolla.cli.local_swarm import LocalSwarm

COMMANDS = ["demo", "dht", "serve", "generate", "chat", "status"]


def corolla(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corolla.cli.main", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_help(command):
    result = corolla(command, "--help")
    assert result.returncode == 0 and "usage: corolla" in result.stdout


def test_dht_prints_full_multiaddrs():
    with LocalSwarm() as swarm:
        maddrs = swarm.start_dht()
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3" in m for m in maddrs)


def test_status_lists_each_server_and_its_blocks(llama_swarm):
    result = corolla("status", "--initial-peers", *llama_swarm.initial_peers, "--model", llama_swarm.model_path, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    spans = sorted((s["start_block"], s["end_block"], s["state"]) for s in report["servers"])
    assert spans == [(0, 2, "online"), (2, 4, "online")]
    assert report["uncovered_blocks"] == [] and report["num_blocks"] == 4


def test_generate_command_prints_a_continuation(llama_swarm, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(llama_swarm.model_path)
    result = corolla("generate", llama_swarm.model_path, "--initial-peers", *llama_swarm.initial_peers, "--max-new-tokens", "5", "w5 w6 w7")
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:3] == ["w5", "w6", "w7"] and len(words) == 8


def test_serve_without_peers_or_new_swarm_is_a_clear_error(tiny_llama_path):
    result = corolla("serve", tiny_llama_path, "--blocks", "0:1")
    assert result.returncode == 2 and "--initial-peers" in result.stderr


def test_serve_with_an_unknown_block_range_is_a_clear_error(tiny_llama_path, llama_swarm):
    result = corolla("serve", tiny_llama_path, "--initial-peers", *llama_swarm.initial_peers, "--blocks", "2:9")
    assert result.returncode == 2 and "outside the model's 4 blocks" in result.stderr


def test_demo_starts_a_swarm_generates_and_cleans_up():
    result = corolla("demo", "--max-new-tokens", "8", "--greedy", "--prompt", "The server", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("The server") and len(result.stdout.split()) > 2
    assert "serves blocks 0:3" in result.stderr and "serves blocks 3:6" in result.stderr
