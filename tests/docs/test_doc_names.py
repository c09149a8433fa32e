"""No page of README.md and docs/*.md names code that does not exist: a module or file, a class or function (and a
member of one: a config field, a message), a `corolla` command or flag, a script's flag (doc_names says what counts
and how each is checked). Every stale name is reported with its page and line.

The checker is also run on small pages written here, each naming things that exist and things that do not, so that
it is seen to find what it must (and only that)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from code_index import CodeIndex
from corolla.cli.main import build_parser
from corolla.protocol import PROTOCOL_VERSION
from doc_names import CliIndex, PageChecker
from doc_snippets import doc_pages

ROOT = Path(__file__).resolve().parents[2]


@cache
def checker() -> PageChecker:
    return PageChecker(CodeIndex(ROOT), CliIndex(build_parser()))


def stale(text: str, page: str = "docs/example.md") -> list[tuple[int, str]]:
    """(line, name) of each stale name the checker finds in the page `text`."""
    return [(f.line, f.name) for f in checker().check(page, text, str(Path(page).parent))]


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in doc_pages(ROOT)])
def test_every_name_a_page_gives_exists(page: str) -> None:
    findings = checker().check(page, (ROOT / page).read_text(), str(Path(page).parent))
    assert not findings, f"{len(findings)} name(s) on {page} that the code does not have:\n" + "\n".join(
        map(str, findings))


def test_paths_modules_and_their_names_are_resolved() -> None:
    page = f"""# Paths
The chain (`client/chain/chain.py`, `src/corolla/client/chain/nothing.py`) and `server/presence/block_selection.py`;
`server/presence/no_selection.py`, `tests/swarm/test_*.py`, `tests/swarm/test_zebra_*.py`, `tests/net` and `bench/results/`.
Modules: `corolla.server.rpc.handler`, `corolla.server.rpc.no_handler`, `server.rpc.handler`, `corolla.netemu`.
Names in them: `corolla.cli.main.build_parser`, `corolla.cli.main.build_parsers`, `corolla.ClientConfig`.
A bare file: `pass_pipe.py`, `session_verifier.py`; see also bench/bench_generate.py and bench/bench_nothing.py.
[a link](../src/corolla/protocol/messages.py), [a dead one](../src/corolla/protocol/telegram.py)
In prose, corolla.client.chain.chain and corolla.client.chainz; `PROTOCOL_VERSION` ({PROTOCOL_VERSION}), not
`PROTOCOL_VERSION` ({PROTOCOL_VERSION - 1}); protocol version {PROTOCOL_VERSION + 1}.
"""
    assert stale(page) == [
        (2, "src/corolla/client/chain/nothing.py"), (3, "server/presence/no_selection.py"),
        (3, "tests/swarm/test_zebra_*.py"), (4, "corolla.server.rpc.no_handler"), (5, "corolla.cli.main.build_parsers"),
        (6, "session_verifier.py"), (6, "bench/bench_nothing.py"), (7, "../src/corolla/protocol/telegram.py"),
        (8, "corolla.client.chainz"), (9, f"PROTOCOL_VERSION ({PROTOCOL_VERSION - 1})"),
        (9, f"protocol version {PROTOCOL_VERSION + 1}"),
    ]


def test_classes_members_config_fields_and_messages_are_resolved() -> None:
    page = """`ClientConfig.verify_rate` and `ClientConfig.verify_rat`; `ServerConfig.num_blocks`, `ServerConfig.blocks_num`.
Messages: `SetPush`, `AllowPush`, `PushStep`; `ServerState.ONLINE`, `ServerState.ASLEEP`; errors `MissingBlocks`,
`ValueError`, `MissingBlock`. Calls: `ClientConfig(verify_rate=0.1)`, `ClientConfig(verify_rat=0.1)`,
`session.rollback(p)`, `session.roll_back(p)`, `session.token_ids`, `session.tokens_ids`, `listening_socket(h, p)`,
`listen_socket(h, p)`, `BlockRange.start`, `BlockRange.begin`, `_no_such_helper`, `verify_rate`, `HF's word`, `llama`.
"""
    assert stale(page) == [
        (1, "ClientConfig.verify_rat"), (1, "ServerConfig.blocks_num"), (2, "AllowPush"), (2, "ServerState.ASLEEP"),
        (3, "MissingBlock"), (3, "ClientConfig(verify_rat=0.1)"), (4, "session.roll_back(p)"),
        (4, "session.tokens_ids"), (5, "listen_socket(h, p)"), (5, "BlockRange.begin"), (5, "_no_such_helper"),
    ]


def test_commands_and_flags_are_checked_against_the_real_parsers() -> None:
    page = """Run `corolla serve MODEL --initial-peers ADDR [--blocks A:B | --num-block N]`, `corolla serv MODEL`,
`--quant int8|nf4`, `--quantize`, `corolla --debug generate`, `make test`, `make tests`,
`python bench/bench_failover.py --kills 20`, `python bench/bench_failover.py --kils 20`.

```bash
corolla dht --host 127.0.0.1 --port 0 &  # a comment: corolla --nothing
PEERS=$(corolla dht --hots 127.0.0.1) corolla generate "$MODEL" \\
    --initial-peers "$PEERS" --max-new-token 5 "hi" | grep hi
.venv/bin/python -m pytest tests/docs/test_doc_names.py::test_every_name_a_page_gives_exists
.venv/bin/python -m pytest tests/docs/test_doc_names.py::test_nothing tests/docs/nothing.py
```
"""
    assert stale(page) == [
        (1, "corolla serve MODEL --initial-peers ADDR [--blocks A:B | --num-block N]"), (1, "corolla serv MODEL"),
        (2, "--quantize"), (2, "make tests"), (3, "python bench/bench_failover.py --kils 20"),
        (7, "corolla dht --hots 127.0.0.1"), (7, "corolla generate $MODEL --initial-peers $PEERS --max-new-token 5 hi"),
        (10, "python -m pytest tests/docs/test_doc_names.py::test_nothing tests/docs/nothing.py"),
        (10, "python -m pytest tests/docs/test_doc_names.py::test_nothing tests/docs/nothing.py"),
    ]


def test_python_blocks_imports_and_keywords_are_resolved() -> None:
    page = """```python
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.config import ClientConfig as Config
from corolla.client.configs import ClientConfig
import corolla.client.chain.chain, corolla.client.chain.chains

config = Config(verify_rate=0.2, verify_rat=0.2)
model = AutoDistributedModelForCausalLM.from_pretrained("m", client_config=config)
```
```text
client/chain/chain.py and client/chain/chainz.py
```
"""
    assert stale(page) == [
        (4, "corolla.client.configs.ClientConfig"), (5, "corolla.client.chain.chains"),
        (7, "Config(verify_rate=0.2, verify_rat=0.2)"), (11, "client/chain/chainz.py"),
    ]


def test_a_finding_names_its_page_line_and_what_is_missing() -> None:
    [finding] = checker().check("docs/x.md", "\n\nsee `corolla.client.chain.chainz`\n")
    assert str(finding) == "docs/x.md:3: `corolla.client.chain.chainz`: module corolla.client.chain has no chainz"
