"""The command line per the public contract: every command answers --help; dht, status and generate work.

`corolla dht`, `generate` and `demo` run as processes, as users run them; what only checks a command's answer (help,
argument errors, status) runs main() in process (conftest.run_corolla)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_corolla, save_word_tokenizer
from corolla.cli.local_swarm import LocalSwarm
from corolla.cli.main import build_parser

COMMANDS = ["demo", "dht", "serve", "generate", "chat", "status"]


def corolla(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corolla.cli.main", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_help(command, capsys):
    """The parser `corolla` runs (`python -m corolla.cli.main` is run as a process by the tests below), in process:
    a process per command only repeats the package's import."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0 and "usage: corolla" in capsys.readouterr().out


def test_dht_prints_full_multiaddrs():
    with LocalSwarm() as swarm:
        maddrs = swarm.start_dht()
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3" in m for m in maddrs)


def test_serve_reports_readiness_in_a_json_line_a_ready_file_and_its_log_line(llama_swarm):
    """Each server printed {"event": "ready", ...} on stdout (LocalSwarm waits for it), wrote the same record to its
    --ready-file, and logged the INFO line `serving blocks A:B` that people read."""
    for name, blocks in (("server-a", "0:2"), ("server-b", "2:4")):
        proc = llama_swarm.procs[name]
        record = proc.ready_records[0]
        assert record == {"event": "ready", "peer_id": llama_swarm.peer_ids[name], "maddrs": proc.maddrs, "blocks": blocks}
        assert proc.maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{proc.peer_id}")
                                   for m in proc.maddrs)
        argv = proc.popen.args
        ready_file = Path(argv[argv.index("--ready-file") + 1])
        assert json.loads(ready_file.read_text()) == record
        assert not list(ready_file.parent.glob(".ready-*")), "a temporary file of the atomic write was left behind"
        assert any(f"serving blocks {blocks} of " in line and f" as {proc.peer_id} " in line for line in proc.log)


def test_status_lists_each_server_and_its_blocks(llama_swarm):
    result = run_corolla("status", "--initial-peers", *llama_swarm.initial_peers, "--model", llama_swarm.model_path, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    spans = sorted((s["start_block"], s["end_block"], s["state"]) for s in report["servers"])
    assert spans == [(0, 2, "online"), (2, 4, "online")]
    assert report["uncovered_blocks"] == [] and report["num_blocks"] == 4


def test_generate_command_prints_a_continuation(llama_swarm, tmp_path):
    save_word_tokenizer(llama_swarm.model_path)
    result = corolla("generate", llama_swarm.model_path, "--initial-peers", *llama_swarm.initial_peers, "--max-new-tokens", "5", "w5 w6 w7")
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:3] == ["w5", "w6", "w7"] and len(words) == 8


def test_serve_without_peers_or_new_swarm_is_a_clear_error(tiny_llama_path):
    result = run_corolla("serve", tiny_llama_path, "--blocks", "0:1")
    assert result.returncode == 2 and "--initial-peers" in result.stderr


def test_serve_with_an_unknown_block_range_is_a_clear_error(tiny_llama_path, llama_swarm):
    result = run_corolla("serve", tiny_llama_path, "--initial-peers", *llama_swarm.initial_peers, "--blocks", "2:9")
    assert result.returncode == 2 and "outside the model's 4 blocks" in result.stderr


def test_demo_starts_a_swarm_generates_and_cleans_up():
    result = corolla("demo", "--max-new-tokens", "8", "--greedy", "--prompt", "The server", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("The server") and len(result.stdout.split()) > 2
    assert "serves blocks 0:3" in result.stderr and "serves blocks 3:6" in result.stderr
