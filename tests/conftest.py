"""Shared fixtures: tiny random checkpoints written by the tests, and real local swarms over them.

A swarm (local_swarms.TestSwarm) is a real DHT bootstrap peer, in the test process, and `corolla serve` processes on
127.0.0.1 (OS-assigned ports), forked from a process that imported the package once (server_zygote), each in its
own process group; the swarm always ends those groups (p2pd included), even when a test fails. A server is ready
when it prints its JSON ready record (peer id, multiaddrs, blocks).

Swarms by topology (`SharedSwarms`): a swarm that several tests or modules use unchanged (the tiny Llama on 0:2 +
2:4, the demo model on 0:3 + 3:6, each family's tiny checkpoint on 0:2 + 2:4) starts once, on first use, and ends
right after the last collected test that uses it; the tests that use one run next to each other (see
`pytest_collection_modifyitems`). After each such test every server of the swarm must be alive with its whole cache
free (`shared_swarms_are_left_clean`). A test that kills, corrupts or exhausts a server starts its own swarm
(`start_swarm`).
"""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import server_zygote
from corolla.cli.local_swarm import LocalSwarm
from local_swarms import (  # noqa: F401 (SERVER_ARGS, wait_until: re-exported for the test modules)
    PROBE,
    SERVER_ARGS,
    NamedSwarm,
    TestSwarm,
    start_named_servers,
    wait_until,
)

# One torch thread in the test process (servers get `--num-threads 1` too, SERVER_ARGS). The tests' tensors are tiny,
# and torch still splits an op over its threads when it has rows to split: on a 2-core machine busy with servers each
# such op waits for a second thread to wake (a softmax of a (1, 4, 4) tensor: 152 us with 2 threads, 1.8 us with 1).
# tests/unit and tests/models took 222 s with 2 threads, 64 s with 1.
torch.set_num_threads(1)

TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)


def make_llama_checkpoint(directory: Path, seed: int = 0, **overrides: object) -> Path:
    """Write a tiny random-weight Llama checkpoint (safetensors + config) and return its directory."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


def run_corolla(*args: str) -> subprocess.CompletedProcess[str]:
    """`corolla ARGS` run in this process as the console script runs it (cli.main.main): its exit code and what it
    printed, as `subprocess.run(..., capture_output=True, text=True)` gives them. For tests of what a command answers
    (help, argument errors, a status report): a process per call would pay the package's import, seconds, again
    (test_cli runs commands as processes). The logging set-up main() installs is undone afterwards."""
    from corolla.cli.main import main

    loggers = [logging.getLogger(name) for name in ("", "corolla", "hivemind")]
    saved = [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: 0 after --help, 2 for a bad argument
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        for logger, (handlers, level, propagate) in zip(loggers, saved):
            logger.handlers[:], logger.propagate = handlers, propagate
            logger.setLevel(level)
    return subprocess.CompletedProcess(["corolla", *args], code, out.getvalue(), err.getvalue())


class SharedSwarms:
    """Swarms shared by topology: `get(key, start)` starts one on first use (`start(local, directory)` writes what
    it needs under `directory` and returns its NamedSwarm) and returns the same one after; `release(key)` ends it.

    Which tests use which key is declared in SHARED_SWARM_FIXTURES; the hooks below run those tests together and
    release each swarm right after its last one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.swarms: dict[str, NamedSwarm] = {}
        self._stacks: dict[str, ExitStack] = {}

    def for_fixture(self, request: pytest.FixtureRequest, start: Callable[[LocalSwarm, Path], NamedSwarm]) -> NamedSwarm:
        """`get` for the fixture `request` is of (one of SHARED_SWARM_FIXTURES): its key, its parameter's swarm."""
        kind = SHARED_SWARM_FIXTURES[request.fixturename]
        return self.get(f"{kind}[{request.param}]" if hasattr(request, "param") else kind, start)

    def get(self, key: str, start: Callable[[LocalSwarm, Path], NamedSwarm]) -> NamedSwarm:
        if key not in self.swarms:
            directory = self.root / key.replace("/", "_")
            directory.mkdir(parents=True, exist_ok=True)
            with ExitStack() as stack:
                log = stack.enter_context(open(directory / "swarm.log", "a"))
                local = stack.enter_context(TestSwarm(log_file=log, env={"COROLLA_CACHE": str(directory / "cache")}))
                self.swarms[key] = start(local, directory)
                self._stacks[key] = stack.pop_all()
        return self.swarms[key]

    def release(self, key: str) -> None:
        self.swarms.pop(key, None)
        stack = self._stacks.pop(key, None)
        if stack is not None:
            stack.close()

    def close(self) -> None:
        for key in list(self._stacks):
            self.release(key)


# fixture name -> the shared swarm it stands on: a test that uses the fixture uses key NAME, or NAME[PARAM] when the
# fixture is parametrized (one swarm per parameter). Fixtures of the same name in different modules share it.
SHARED_SWARM_FIXTURES = {
    "llama_swarm": "llama",  # below: the tiny Llama, 0:2 + 2:4
    "varied_llama_swarm": "varied-llama",  # below: a tiny Llama whose greedy output varies, 0:2 + 2:4
    "demo_swarm": "demo",  # below: the demo model, 0:3 + 3:6, float32
    "family": "family",  # test_families, test_speculative: one family's tiny checkpoint, 0:2 + 2:4
}
_SHARED = SharedSwarms(Path())  # its root is set by the `shared_swarms` fixture
_last_user: dict[str, str] = {}  # key -> nodeid of the last collected test that uses it


def shared_swarm_keys(item: pytest.Item) -> list[str]:
    """The SharedSwarms keys `item` uses (SHARED_SWARM_FIXTURES), in its fixtures' order."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    keys = []
    for name in getattr(item, "fixturenames", ()):
        if name in SHARED_SWARM_FIXTURES:
            kind = SHARED_SWARM_FIXTURES[name]
            keys.append(f"{kind}[{params[name]}]" if name in params else kind)
    return keys


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the users of each shared swarm one after another: a test that uses a swarm first used earlier moves to
    right after that swarm's earlier users (order otherwise kept), so each swarm lives once, for a stretch."""
    first: dict[str, int] = {}
    anchors = []
    for index, item in enumerate(items):
        keys = shared_swarm_keys(item)
        for key in keys:
            first.setdefault(key, index)
        anchors.append(min([index, *(first[key] for key in keys)]))
    items[:] = [item for _, _, item in sorted(zip(anchors, range(len(items)), items), key=lambda t: t[:2])]
    _last_user.clear()
    for item in items:
        for key in shared_swarm_keys(item):
            _last_user[key] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    for key in shared_swarm_keys(item):
        if _last_user.get(key) == item.nodeid:
            _SHARED.release(key)


def pytest_sessionstart(session: pytest.Session) -> None:
    server_zygote.start()  # its imports overlap collection and the first tests


def pytest_sessionfinish(session: pytest.Session) -> None:
    _SHARED.close()
    PROBE.close()
    server_zygote.close()


@pytest.fixture(scope="session")
def shared_swarms(tmp_path_factory: pytest.TempPathFactory) -> SharedSwarms:
    _SHARED.root = tmp_path_factory.mktemp("shared-swarms")
    return _SHARED


@pytest.fixture(autouse=True)
def shared_swarms_are_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on a shared swarm: every server of it alive, its whole cache free."""
    yield
    for key in shared_swarm_keys(request.node):
        if key in _SHARED.swarms:
            _SHARED.swarms[key].assert_clean()


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama"))


@pytest.fixture(scope="module")
def llama_swarm(request: pytest.FixtureRequest, tiny_llama_path: str, shared_swarms: SharedSwarms) -> NamedSwarm:
    """A DHT peer and two servers splitting the tiny Llama's 4 blocks as 0:2 (server-a) and 2:4 (server-b), each
    also writing its ready record to a --ready-file (test_cli reads them)."""
    return shared_swarms.for_fixture(request, lambda local, directory: start_named_servers(local, tiny_llama_path, {
        name: ["--blocks", blocks, "--ready-file", str(directory / f"{name}.ready.json")]
        for name, blocks in (("server-a", "0:2"), ("server-b", "2:4"))}))


@pytest.fixture(scope="module")
def varied_llama_swarm(request: pytest.FixtureRequest, shared_swarms: SharedSwarms) -> NamedSwarm:
    """Two servers (blocks 0:2, 2:4) of a tiny Llama whose greedy output varies (a larger init than HF's) and which
    has a word-level tokenizer (save_word_tokenizer): test_generation, test_hf_surface."""
    def start(local: LocalSwarm, directory: Path) -> NamedSwarm:
        path = str(make_llama_checkpoint(directory / "tiny-llama", initializer_range=0.2))
        save_word_tokenizer(path)
        return start_named_servers(local, path, {f"varied-{b}": ["--blocks", b] for b in ("0:2", "2:4")})

    return shared_swarms.for_fixture(request, start)


@pytest.fixture(scope="module")
def demo_swarm(request: pytest.FixtureRequest, shared_swarms: SharedSwarms) -> NamedSwarm:
    """The embedded demo model's 6 blocks on two float32 servers, demo-0:3 and demo-3:6: test_sessions,
    test_speculative."""
    from corolla.cli.demo_cmd import demo_model_path

    return shared_swarms.for_fixture(request, lambda local, _: start_named_servers(
        local, str(demo_model_path()), {f"demo-{b}": ["--blocks", b, "--dtype", "float32"] for b in ("0:3", "3:6")}))


def save_word_tokenizer(path: str):
    """A word-level tokenizer over the tiny vocabulary, saved to `path`: token i is the word "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture
def start_swarm(tiny_llama_path: str, tmp_path: Path) -> Iterator[Callable[..., NamedSwarm]]:
    """start_swarm(name=(blocks, extra args), ...) -> a DHT and those servers over the tiny Llama, all ended after
    the test: for a test that kills, corrupts or exhausts a server."""
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}) as local:
        def start(**servers: tuple[str, list[str]]) -> NamedSwarm:
            return start_named_servers(
                local, tiny_llama_path, {name: ["--blocks", blocks, *extra] for name, (blocks, extra) in servers.items()}
            )

        yield start


class FakeHub:
    """Serves a local directory as a hub repo; like hf_hub_download, reuses a file already in the cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.downloads: list[str] = []

    def list_files(self, repo_id, *, revision, token, cache_dir):
        return {p.name: p.stat().st_size for p in sorted(self.root.iterdir())}

    def download(self, repo_id, filename, *, revision, token, cache_dir):
        target = Path(cache_dir) / "fake-hub" / repo_id.replace("/", "--") / (revision or "main") / filename
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.root / filename, target)
            self.downloads.append(filename)
        return target
