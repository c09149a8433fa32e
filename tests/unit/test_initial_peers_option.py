"""`--initial-peers` on every command: one value (comma-separated multiaddrs), repeatable, never swallowing the
positional arguments after it."""

from __future__ import annotations

import pytest

from conftest import run_corolla
from corolla.cli.main import build_parser

A = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWA"
B = "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWB"
C = "/ip4/10.0.0.3/tcp/31337/p2p/12D3KooWC"


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_generate_keeps_the_prompt_after_initial_peers():
    args = parse("generate", "path/or/hf-repo", "--initial-peers", A, "Once upon a time")
    assert args.initial_peers == [A] and args.prompt == "Once upon a time" and args.model == "path/or/hf-repo"


def test_comma_separated_and_repeated_values_add_up_in_order():
    args = parse("generate", "m", "--initial-peers", f"{A},{B}", "--initial-peers", C, "hi")
    assert args.initial_peers == [A, B, C] and args.prompt == "hi"
    args = parse("chat", "m", "--initial-peers", f" {A} , {B} ")
    assert args.initial_peers == [A, B]


@pytest.mark.parametrize("command, after", [
    (["serve", "m"], []), (["dht"], []), (["status"], []), (["api", "m"], []), (["monitor"], []),
    (["generate", "m"], ["a prompt"]), (["chat", "m"], []),
])
def test_every_command_takes_one_value_comma_separated_or_repeated(command, after):
    args = parse(*command, "--initial-peers", A, *after)
    assert list(args.initial_peers) == [A]
    args = parse(*command, "--initial-peers", f"{A},{B}", "--initial-peers", C, *after)
    assert list(args.initial_peers) == [A, B, C]


def test_commands_built_from_config_dataclasses_get_a_tuple_of_peers():
    from corolla.cli.dataclass_args import dataclass_from_args
    from corolla.server.config import ServerConfig

    config = dataclass_from_args(ServerConfig, parse("serve", "m", "--initial-peers", f"{A},{B}", "--blocks", "0:3"))
    assert config.initial_peers == (A, B) and config.blocks == "0:3"
    assert dataclass_from_args(ServerConfig, parse("serve", "m")).initial_peers == ()  # the dataclass default


def test_a_second_value_after_one_use_is_not_a_peer():
    # the old nargs="+" took both; now the second is an extra argument, refused by name
    run = run_corolla("serve", "m", "--initial-peers", A, B)
    assert run.returncode == 2 and "unrecognized arguments: " + B in run.stderr


def test_an_empty_value_is_a_clear_error():
    run = run_corolla("status", "--initial-peers", ",")
    assert run.returncode == 2 and "--initial-peers needs a multiaddr" in run.stderr and "Traceback" not in run.stderr


def test_help_says_how_to_give_several_peers():
    run = run_corolla("generate", "--help")
    assert run.returncode == 0 and "--initial-peers ADDR[,ADDR...]" in run.stdout
    assert "comma-separated" in run.stdout
