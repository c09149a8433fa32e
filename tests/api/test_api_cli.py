"""`corolla api` on the command line: its flags (generated from ApiConfig) and its errors before any network."""

from __future__ import annotations

import subprocess

from conftest import run_corolla
from corolla.api.config import ApiConfig
from corolla.cli.main import build_parser


def test_api_flags_match_the_design_contract_and_default_from_the_config():
    args = build_parser().parse_args(["api", "some/model", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"])
    assert (args.model, args.initial_peers) == ("some/model", ["/ip4/127.0.0.1/tcp/1/p2p/X"])
    assert not hasattr(args, "port")  # unset flags keep ApiConfig's defaults
    assert (ApiConfig.host, ApiConfig.port, ApiConfig.model_name) == ("127.0.0.1", 8000, None)
    args = build_parser().parse_args(["api", "m", "--initial-peers", "p", "--host", "0.0.0.0", "--port", "0",
                                      "--model-name", "mine"])
    assert (args.host, args.port, args.model_name) == ("0.0.0.0", 0, "mine")
    assert ApiConfig.verify_rate == 0.0  # spot checks off unless asked for
    assert build_parser().parse_args(["api", "m", "--initial-peers", "p", "--verify-rate", "0.1"]).verify_rate == 0.1


def test_api_without_initial_peers_is_a_clear_error():
    run = run_corolla("api", "some/model")
    assert run.returncode == 2 and "--initial-peers is required" in run.stderr
    assert "Traceback" not in run.stderr


def test_api_help():
    run = run_corolla("api", "--help")
    assert run.returncode == 0
    for flag in ("--initial-peers", "--host", "--port", "--model-name", "--max-idle-sessions"):
        assert flag in run.stdout


def run_api(*args: str) -> subprocess.CompletedProcess:
    return run_corolla("api", "some/model", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X", *args)


def test_api_without_keys_refuses_to_listen_beyond_loopback_unless_told_to():
    for host in ("0.0.0.0", "::", "10.0.0.1"):
        run = run_api("--host", host)
        assert run.returncode == 2 and "refusing to listen" in run.stderr and "--api-keys" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    args = build_parser().parse_args(["api", "m", "--initial-peers", "p", "--host", "0.0.0.0", "--insecure-no-auth"])
    assert args.insecure_no_auth is True and ApiConfig.insecure_no_auth is False


def test_api_verify_rate_outside_0_1_is_a_clear_error():
    run = run_api("--verify-rate", "1.5")
    assert run.returncode == 2 and "--verify-rate must be within [0, 1]" in run.stderr and "Traceback" not in run.stderr


def test_api_keys_file_errors_are_clear_and_come_before_any_network(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing but a comment\n\n")
    for path, message in [(empty, "holds no key"), (tmp_path / "missing", "cannot read")]:
        run = run_api("--api-keys", str(path), "--host", "0.0.0.0")
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_api_help_lists_the_multi_user_flags():
    run = run_corolla("api", "--help")
    for flag in ("--api-keys", "--insecure-no-auth", "--allowed-hosts", "--max-body-bytes", "--max-streams-per-key",
                 "--public-metrics"):
        assert flag in run.stdout
    assert (ApiConfig.max_body_bytes, ApiConfig.max_streams_per_key, ApiConfig.allowed_hosts) == (4 * 1024 * 1024, 64, ())
