"""The docs test's page runner fails where a reader following the page would fail, and leaves nothing running."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from doc_page_runner import PageRun, SnippetFailed, fixed_ports
from doc_snippets import extract


def page(tmp_path: Path, text: str) -> list:
    path = tmp_path / "page.md"
    path.write_text(text)
    return extract(path, tmp_path)


def runner(tmp_path: Path, **names: object) -> PageRun:
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    return PageRun(workdir, env, names)


def test_a_bash_snippet_that_fails_on_any_line_fails_naming_its_page_and_line(tmp_path):
    snippets = page(tmp_path, "text\n\n```bash\ntrue\nfalse\necho never\n```\n")
    with runner(tmp_path) as run, pytest.raises(SnippetFailed, match=r"page.md:3: exited with 1"):
        run.run(snippets[0])


def test_python_snippets_share_a_namespace_with_the_given_names_and_fail_with_their_traceback(tmp_path):
    snippets = page(tmp_path, "```python\ntotal = len(PEERS)\n```\n\n```python\nassert total == 2\n1 / total\n"
                              "1 / 0\n```\n")
    with runner(tmp_path, PEERS=["a", "b"]) as run:
        run.run(snippets[0])
        with pytest.raises(SnippetFailed, match=r'(?s)page.md:5: raised.*File "page.md:5", line 3.*ZeroDivisionError'):
            run.run(snippets[1])


@pytest.mark.slow  # the runner's processes: it serves the docs' snippets, which run in the slow tier too
def test_a_background_command_that_exits_before_it_is_ready_fails_the_page(tmp_path):
    snippets = page(tmp_path, "<!-- snippet: background -->\n```bash\ncorolla serve /no/such/model --new-swarm\n```\n")
    with runner(tmp_path) as run, pytest.raises(SnippetFailed, match=r"`corolla serve /no/such/model --new-swarm` exited"):
        run.run(snippets[0])


@pytest.mark.slow  # a real `corolla dht` in the background: as above
def test_a_background_dht_sets_its_variable_and_is_stopped_when_the_page_ends(tmp_path):
    snippets = page(tmp_path, "<!-- snippet: background, sets MINE -->\n```bash\ncorolla dht\n```\n\n"
                              "```bash\necho \"$MINE\" > mine.txt\n```\n\n```python\nassert MINE[0].startswith('/ip4/')\n```\n")
    with runner(tmp_path) as run:
        for snippet in snippets:
            run.run(snippet)
        dht = run.background[0]
        assert dht.poll() is None
        assert (tmp_path / "work" / "mine.txt").read_text().startswith("/ip4/127.0.0.1/tcp/")
    assert dht.poll() is not None  # stopped with the page
    with pytest.raises(ProcessLookupError):
        os.killpg(dht.pid, 0)  # its whole process group (p2pd included) is gone


def test_fixed_ports_are_the_ones_runnable_snippets_use():
    snippets = extract(Path(__file__).resolve().parents[2] / "docs" / "monitoring.md", Path(__file__).resolve().parents[2])
    assert fixed_ports(snippets) == {8080, 9100}
