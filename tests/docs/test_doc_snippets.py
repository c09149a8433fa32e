"""Every command and Python snippet of README.md and docs/*.md runs as written, against a real local swarm.

One swarm per module: a DHT peer and two `corolla serve` processes splitting the demo model shipped with corolla
(blocks 0:3 and 3:6). Each page then runs its snippets in order (doc_page_runner), with `MODEL` (the demo model's
directory), `PEERS` (the DHT's multiaddr) and `DRAFT` (the demo model's draft) given, as the docs say; the rules for
blocks that are not run, or run until stopped, are in doc_snippets.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from corolla.cli.demo_cmd import demo_draft_path, demo_model_path
from corolla.cli.local_swarm import LocalSwarm
from doc_page_runner import PageRun, fixed_ports, port_in_use
from doc_snippets import Snippet, SnippetError, doc_pages, extract

ROOT = Path(__file__).resolve().parents[2]
SERVER_ARGS = ["--num-threads", "1"]
EXTERNAL_TOOLS = ("curl",)  # commands the snippets use beyond bash, grep and the virtualenv's own


def page_snippets() -> dict[str, list[Snippet]]:
    return {path.relative_to(ROOT).as_posix(): extract(path, ROOT) for path in doc_pages(ROOT)}


def runnable_pages() -> list[str]:
    """The pages with a snippet to run (and any page breaking the rules, so that its test fails saying why)."""
    pages = []
    for path in doc_pages(ROOT):
        try:
            if any(s.runnable for s in extract(path, ROOT)):
                pages.append(path.relative_to(ROOT).as_posix())
        except SnippetError:
            pages.append(path.relative_to(ROOT).as_posix())
    return pages


@pytest.fixture(scope="module")
def docs_swarm(tmp_path_factory: pytest.TempPathFactory):
    """The demo model on two servers (0:3, 3:6) behind one DHT peer; yields (env, names) for the snippets."""
    cache = tmp_path_factory.mktemp("corolla-cache")
    log_path = tmp_path_factory.mktemp("logs") / "docs-swarm.log"
    model, draft = str(demo_model_path()), str(demo_draft_path())
    with open(log_path, "w") as log, LocalSwarm(log_file=log, env={"COROLLA_CACHE": str(cache)}) as swarm:
        peers = swarm.start_dht()
        servers = [swarm.start_server(model, ["--blocks", blocks, *SERVER_ARGS], name=f"docs-{blocks}", wait=False)
                   for blocks in ("0:3", "3:6")]
        for proc in servers:
            swarm.wait_ready(proc)
        bin_dir = str(Path(sys.executable).parent)
        env = {**os.environ, "MODEL": model, "PEERS": ",".join(peers), "DRAFT": draft, "COROLLA_CACHE": str(cache),
               "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1"}
        yield env, {"MODEL": model, "PEERS": peers, "DRAFT": draft}


def make_lora_adapter(directory: Path, model: str) -> None:
    """A peft LoRA adapter (rank 4 on q_proj and v_proj, non-zero updates) for the checkpoint `model`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tuned = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    tuned.save_pretrained(directory)


def test_every_page_keeps_the_snippet_rules():
    """Languages, markers and background commands check out on every page (extract raises otherwise), and every
    block that is not run says why."""
    for page, snippets in page_snippets().items():
        for snippet in snippets:
            if snippet.mode == "not run":
                assert snippet.reason.strip(), f"{snippet.origin}: say why it is not run"
    assert len(runnable_pages()) >= 10


def test_a_page_breaking_the_rules_is_refused(tmp_path):
    page = tmp_path / "page.md"
    for text, problem in [
        ("```\ncorolla dht\n```\n", "language"),
        ("```sh\nls\n```\n", "language"),
        ("<!-- snippet: not run -->\n```bash\nls\n```\n", "unknown snippet marker"),
        ("<!-- snippet: background -->\n```bash\nsleep 100\n```\n", "background command"),
        ("<!-- snippet: background, sets PEERS -->\n```bash\ncorolla monitor --port 1\n```\n", "needs a `corolla dht`"),
        ("<!-- snippet: background -->\n\n```bash\ncorolla dht\n```\n", "right before a fence"),
        ("```bash\nls\n", "not closed"),
    ]:
        page.write_text(text)
        with pytest.raises(SnippetError, match=problem):
            extract(page, tmp_path)


@pytest.mark.slow  # minutes of swarm commands, run by `make test-all` (CI); `pytest tests/docs -m ""` runs them alone
@pytest.mark.parametrize("page", runnable_pages())
def test_page_snippets_run_as_written(page: str, docs_swarm, tmp_path: Path):
    env, names = docs_swarm
    snippets = extract(ROOT / page, ROOT)
    busy = sorted(port for port in fixed_ports(snippets) if port_in_use(port))
    if busy:
        pytest.skip(f"{page} uses fixed ports {busy}, which another program holds on this machine now")
    for tool in EXTERNAL_TOOLS:
        if shutil.which(tool) is None and any(re.search(rf"\b{tool}\b", s.code) for s in snippets if s.runnable):
            pytest.skip(f"{page} uses {tool}, which is not installed here")
    if any("./my-lora" in s.code for s in snippets if s.runnable):
        make_lora_adapter(tmp_path / "my-lora", names["MODEL"])
    with PageRun(tmp_path, env, names) as run:
        for snippet in snippets:
            if snippet.runnable:
                run.run(snippet)
