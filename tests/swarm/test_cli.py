"""The command line per the public contract: every command answers --help; dht, status and generate work; every
error a user can cause or meet (a bad flag or value, a malformed or unreachable peer, a model or blocks that are not
there, a port in use) is one line on stderr that says what to do, with a non-zero exit, never a traceback (unless
`corolla --debug`).

`corolla dht`, `generate` and `demo` run as processes, as users run them; what only checks a command's answer (help,
argument errors, status) runs main() in process (conftest.run_corolla)."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_llama_checkpoint, run_corolla, save_word_tokenizer
from corolla.cli.errors import explain
from corolla.cli.local_swarm import LocalSwarm
from corolla.cli.main import build_parser
from corolla.protocol.errors import MissingBlocks, PeerUnavailable

COMMANDS = ["demo", "dht", "serve", "generate", "chat", "status", "api", "monitor", "models", "swarm-key", "simulate"]
# a well-formed multiaddr where nothing listens (port 1 on loopback): an unreachable peer
NOBODY = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWQ7bQ7RxwDZJuyyDQPxMbhH5Kd1BMZrGXRX6C7s6rsjs1"


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


def error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line a failed command printed as its error (after any log lines), checked to be the last line of
    stderr, with exit code `code` and no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and lines and lines[-1].startswith("corolla"), result.stderr
    assert sum(": error: " in line for line in lines) == 1, result.stderr
    return lines[-1]


@pytest.mark.parametrize(("blocks", "message"), [
    ("2:9", "--blocks 2:9 is outside the model's 4 blocks (valid: 0 <= A < B <= 4)"),
    ("3:2", "outside the model's 4 blocks"),
    ("two", "--blocks must look like A:B (e.g. 0:4), got 'two'"),
])
def test_serve_with_bad_blocks_says_so_before_joining_the_swarm(tiny_llama_path, blocks, message):
    """Checked against the checkpoint before anything else: the peer given is never dialed (nothing listens there)."""
    result = run_corolla("serve", tiny_llama_path, "--initial-peers", NOBODY, "--blocks", blocks)
    assert message in error_line(result, 2)


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "m", "--initial-peers", NOBODY, "--blokcs", "0:2"],
     "unrecognized arguments: --blokcs 0:2; did you mean --blocks?"),
    (["generate", "m", "--initial-peers", NOBODY, "--max-new-tokens", "many", "hi"],
     "argument --max-new-tokens: invalid int value: 'many'"),
    (["generate", "m", "hi"], "the following arguments are required: --initial-peers"),
    (["api", "m", "--initial-peers", NOBODY, "--compression", "zip"], "argument --compression: invalid choice: 'zip'"),
])
def test_a_bad_flag_or_value_is_one_line_naming_it(argv, message):
    line = error_line(run_corolla(*argv), 2)
    assert message in line and line.endswith("--help` lists the options)"), line


@pytest.mark.parametrize("peer", ["garbage", "/ip4/127.0.0.1/tcp/31337", "/ip4/127.0.0.999/tcp/1/p2p/12D3KooWA"])
def test_a_malformed_initial_peer_is_refused_before_anything_starts(peer):
    line = error_line(run_corolla("generate", "some/model", "--initial-peers", peer, "hi"), 2)
    assert "--initial-peers: " in line and "expected the full multiaddr a running peer printed" in line


@pytest.mark.parametrize("command", ["generate", "serve", "api"])
def test_a_model_that_is_not_there_is_named_with_what_to_give(command, tmp_path):
    prompt = ["hi"] if command == "generate" else []
    line = error_line(run_corolla(command, str(tmp_path / "no-such-model"), "--initial-peers", NOBODY, *prompt), 2)
    assert "no-such-model" in line
    assert "Give a checkpoint directory (with config.json) or a Hugging Face repo id" in line


def test_a_checkpoint_without_a_tokenizer_or_a_missing_demo_model_says_what_is_needed(tiny_llama_path, tmp_path):
    bare = tmp_path / "bare"  # a config and nothing else (test_generate_command gives tiny_llama_path a tokenizer)
    bare.mkdir()
    shutil.copy(Path(tiny_llama_path) / "config.json", bare)
    line = error_line(run_corolla("generate", str(bare), "--initial-peers", NOBODY, "hi"), 2)
    assert f"cannot load the tokenizer of {bare}" in line and "needs its tokenizer files" in line
    line = error_line(run_corolla("demo", "--model", str(tmp_path / "no-such-model")), 2)
    assert "no-such-model" in line and "Give a checkpoint directory (with config.json)" in line


def test_a_port_in_use_says_which_and_how_to_get_another(tiny_llama_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv in (["api", tiny_llama_path, "--initial-peers", NOBODY, "--port", port], ["dht", "--port", port]):
            line = error_line(run_corolla(*argv), 2)
            assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in line and "--port 0" in line, line


def test_unreachable_initial_peers_are_named_with_what_to_check():
    line = error_line(run_corolla("status", "--initial-peers", NOBODY), 1)
    assert f"could not reach any initial peer ({NOBODY}). Is the swarm running" in line


def test_debug_shows_the_traceback_as_well(tmp_path):
    argv = ["generate", str(tmp_path / "no-such-model"), "--initial-peers", NOBODY, "hi"]
    plain, debug = run_corolla(*argv), run_corolla("--debug", *argv)
    assert "Traceback" not in plain.stderr and "Traceback (most recent call last)" in debug.stderr
    assert debug.returncode == plain.returncode == 2
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip().splitlines()[-1]


def test_explain_writes_each_failure_as_one_line_with_what_to_do():
    args = build_parser().parse_args(["generate", "org/model", "--initial-peers", NOBODY, "hi"])
    line, code = explain(MissingBlocks([2, 3]), args)
    assert code == 1 and line.startswith("no server in the swarm holds blocks 2:4. Start a server for them")
    assert f"`corolla serve org/model --initial-peers {NOBODY} --blocks 2:4`" in line
    assert f"`corolla status --initial-peers {NOBODY} --model org/model`" in line
    line, code = explain(MissingBlocks([1, 5]), args)  # two spans: no single --blocks to suggest
    assert code == 1 and "holds blocks 1:2, 5:6" in line and "--blocks" not in line
    line, code = explain(PeerUnavailable("server X did not answer\nin time"), args)
    assert code == 1 and line.startswith("server X did not answer (the swarm failed this request: try again")
    line, code = explain(RuntimeError("something\nbroke"), args)
    assert code == 1 and line == ("RuntimeError: something (unexpected: run `corolla --debug generate ...` for the "
                                  "traceback, and report it)")
    line, code = explain(OSError("2026/11/28 21:01:53 failed to listen on any addresses: [listen tcp4 "
                                 "127.0.0.1:47123: bind: address already in use]"), args)
    assert code == 2 and line.startswith("cannot listen on 127.0.0.1:47123: the port is in use")
    assert all("\n" not in explain(e, args)[0] for e in (ValueError("a\nb"), OSError("model x\ny"), KeyError("k")))


@pytest.fixture(scope="module")
def longer_model(llama_swarm, tmp_path_factory) -> str:
    """The tiny Llama with 6 blocks under the same name (so the same DHT prefix) as the shared swarm's, which
    serves 4: against it, blocks 4:6 have no server."""
    path = str(make_llama_checkpoint(tmp_path_factory.mktemp("longer") / Path(llama_swarm.model_path).name,
                                     num_hidden_layers=6))
    save_word_tokenizer(path)
    return path


def test_generate_against_a_swarm_missing_blocks_names_them_and_the_server_to_start(llama_swarm, longer_model):
    result = run_corolla("generate", longer_model, "--initial-peers", *llama_swarm.initial_peers,
                         "--max-new-tokens", "2", "w5 w6")
    line = error_line(result, 1)
    assert "no server in the swarm holds blocks 4:6" in line
    assert f"corolla serve {longer_model} --initial-peers {llama_swarm.initial_peers[0]} --blocks 4:6" in line


def test_chat_against_a_swarm_missing_blocks_names_them(llama_swarm, longer_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w6\n\n"))
    result = run_corolla("chat", longer_model, "--initial-peers", *llama_swarm.initial_peers, "--max-new-tokens", "2")
    assert "no server in the swarm holds blocks 4:6" in error_line(result, 1)


def test_demo_starts_a_swarm_generates_and_cleans_up():
    result = corolla("demo", "--max-new-tokens", "8", "--greedy", "--prompt", "The server", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("The server") and len(result.stdout.split()) > 2
    assert "serves blocks 0:3" in result.stderr and "serves blocks 3:6" in result.stderr


def test_api_warns_at_start_about_blocks_no_server_holds(caplog):
    """`corolla api` starts even while the swarm lacks blocks (servers may join later; meanwhile each request gets
    503 missing_blocks), and says so once: which blocks, and the command that serves them."""
    from types import SimpleNamespace

    from corolla.api.config import ApiConfig
    from corolla.cli.api_cmd import _default_max_length, _session_limits
    from corolla.protocol.messages import ServerState

    async def update(force: bool = False) -> None:
        return None

    online = SimpleNamespace(state=ServerState.ONLINE, max_session_length=512)
    joining = SimpleNamespace(state=ServerState.JOINING, max_session_length=2048)
    manager = SimpleNamespace(update=update, block_servers=[{"a": online}, {"b": joining}, {}, {"a": online}])
    model = SimpleNamespace(sequence_manager=manager, config=SimpleNamespace(max_position_embeddings=1024))
    config = ApiConfig(model="org/model", initial_peers=(NOBODY,))
    with caplog.at_level("WARNING", logger="corolla.cli.api_cmd"):
        limits = _session_limits(model, config)
    assert limits == [512, None, None, 512] and _default_max_length(model, limits) == 512
    assert [r.getMessage() for r in caplog.records] == [
        "no server in the swarm holds blocks 1:3 now: requests fail (503, missing_blocks) until one does "
        f"(`corolla serve org/model --initial-peers {NOBODY} --blocks 1:3`)"]
