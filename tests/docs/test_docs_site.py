"""The documentation as a whole: the MkDocs site builds with strict checks (a broken link or anchor fails it), its
nav lists every page, every page is reachable from the README, and the README stays a short front page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from doc_snippets import markdown_links

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def local_target(page: Path, link: str) -> Path | None:
    """The file a relative link points to (anchor dropped), or None for a web link or an anchor in the same page."""
    if re.match(r"^[a-z]+:", link) or link.startswith("#"):
        return None
    return (page.parent / link.split("#")[0]).resolve()


def test_the_site_builds_with_strict_link_and_anchor_checks(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-4000:]
    for page in DOCS.glob("*.md"):
        built = tmp_path / "site" / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.exists(), f"{page.name} was not built"


def test_the_nav_lists_every_page_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md")) and len(listed) == len(set(listed))


def test_every_page_is_reachable_from_the_readme_and_every_local_link_resolves():
    readme = ROOT / "README.md"
    seen, todo = {readme}, [readme]
    while todo:
        page = todo.pop()
        for link in markdown_links(page):
            target = local_target(page, link)
            if target is None:
                continue
            assert target.exists(), f"{page.relative_to(ROOT)} links to {link}, which does not exist"
            if target.suffix == ".md" and target not in seen:
                seen.add(target)
                todo.append(target)
    unreachable = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in seen)
    assert not unreachable, f"pages no link leads to from README.md: {unreachable}"


def test_the_readme_is_a_short_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference material into docs/"
    assert max(len(line) for line in lines if not line.startswith("|")) <= 160


def test_the_readme_starts_with_the_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)


def test_the_docs_speak_of_the_software_not_of_how_it_was_built():
    pattern = re.compile(r"\b(this issue|the issue's|this stop|last stop|today's protocol|issue \d+)\b", re.I)
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
