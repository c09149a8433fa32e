"""The fenced code blocks of README.md and docs/*.md, and how the docs test runs each one (pure: no processes).

A block's language says what it is: `bash` and `python` blocks are commands and code, run by the test; `text` and
`json` blocks are output, diagrams and formats, never run. Any other language, or none, is refused, so a command
cannot hide in an unmarked block.

A bash or python block runs as written unless the line right before its opening fence is one of these markers
(HTML comments: invisible on GitHub and on the MkDocs site):

    <!-- snippet: not run (REASON) -->           never run; the reason (a GPU, root, the internet...) is required
    <!-- snippet: background -->                 bash only: each command starts a process that runs until stopped
    <!-- snippet: background, sets NAME -->      the same; the `corolla dht` in it sets $NAME to its address

Background commands start one after the other, each once it is ready (`corolla dht` printed its address, `corolla
serve` logged `serving blocks`, `corolla api` / `corolla monitor` logged their URL), and stop when the page's test
ends.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

RUNNABLE = ("bash", "python")
NOT_RUN_LANGUAGES = ("text", "json")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<lang>[^`\s]*)\s*$")
MARKER = re.compile(r"^<!-- snippet: (?P<body>.*?) -->$")
NOT_RUN = re.compile(r"^not run \((?P<reason>.+)\)$")
BACKGROUND = re.compile(r"^background(?:, sets (?P<name>[A-Z_][A-Z0-9_]*))?$")

ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LEADING_ASSIGNMENTS = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)(.*)$", re.DOTALL)

# what a background command prints once it is ready, by `corolla` subcommand
READY = {
    "dht": re.compile(r"^/ip4/\S+/p2p/\S+$"),
    "serve": re.compile(r"serving blocks \d+:\d+"),
    "api": re.compile(r"at http://\S+/v1"),
    "monitor": re.compile(r"monitor serving at http://"),
}


@dataclass(frozen=True)
class Snippet:
    page: str  # the page's path from the repository root, e.g. "docs/serving.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mode: str  # "run", "background" or "not run"
    reason: str = ""  # why a "not run" block is not run
    sets: str | None = None  # background: the variable its `corolla dht` sets

    @property
    def origin(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE and self.mode != "not run"


class SnippetError(ValueError):
    """A page breaks the rules above; the message names the page and line."""


def extract(path: Path, root: Path) -> list[Snippet]:
    """Every fenced block of the Markdown file `path`, in order; SnippetError for a block that breaks the rules."""
    page = path.relative_to(root).as_posix()
    lines = path.read_text().splitlines()
    snippets: list[Snippet] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            if MARKER.match(lines[i].strip()) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                raise SnippetError(f"{page}:{i + 1}: a snippet marker must be the line right before a fence")
            i += 1
            continue
        fence, lang = opening["fence"], opening["lang"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == fence), None)
        if end is None:
            raise SnippetError(f"{page}:{i + 1}: the block is not closed")
        if lang not in RUNNABLE + NOT_RUN_LANGUAGES:
            raise SnippetError(f"{page}:{i + 1}: a block's language must be one of {RUNNABLE + NOT_RUN_LANGUAGES}, "
                               f"got {lang!r}")
        mode, reason, sets = _marker(lines[i - 1].strip() if i else "", page, i + 1, lang)
        snippet = Snippet(page, i + 1, lang, "\n".join(lines[i + 1 : end]) + "\n", mode, reason, sets)
        if mode == "background":
            commands = background_commands(snippet)  # checked now, so a bad page fails before anything runs
            if sets is not None and not any(argv[1] == "dht" for argv in commands):
                raise SnippetError(f"{snippet.origin}: 'sets {sets}' needs a `corolla dht` command in the block")
        snippets.append(snippet)
        i = end + 1
    return snippets


def _marker(line: str, page: str, number: int, lang: str) -> tuple[str, str, str | None]:
    found = MARKER.match(line)
    if found is None:
        return "run", "", None
    body = found["body"]
    if (not_run := NOT_RUN.match(body)) is not None:
        return "not run", not_run["reason"], None
    if (background := BACKGROUND.match(body)) is not None and lang == "bash":
        return "background", "", background["name"]
    raise SnippetError(f"{page}:{number}: unknown snippet marker {line!r} (see tests/docs/doc_snippets.py)")


def commands(code: str) -> list[str]:
    """The commands of a bash block: its lines, `\\`-continued lines joined, blank and comment lines dropped."""
    joined: list[str] = []
    pending = ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            joined.append(line.strip())
    return joined


def exec_form(command: str) -> str:
    """`command` for `bash -c` with bash replaced by the command itself (`VAR=x exec corolla ...`), so that a signal
    to the process reaches corolla, which then shuts down cleanly."""
    found = LEADING_ASSIGNMENTS.match(command)
    assert found is not None  # the pattern matches every string
    return f"{found[1]}exec {found[2]}"


def background_commands(snippet: Snippet) -> list[list[str]]:
    """argv (comments dropped, variables unexpanded) of each command of a background block; SnippetError unless each
    is a `corolla` command whose readiness the test knows."""
    result = []
    for command in commands(snippet.code):
        argv = shlex.split(command, comments=True)
        while argv and ENV_ASSIGNMENT.match(argv[0]):  # VAR=value corolla ...
            argv = argv[1:]
        if len(argv) < 2 or argv[0] != "corolla" or argv[1] not in READY:
            raise SnippetError(f"{snippet.origin}: a background command must be `corolla {'|'.join(READY)} ...`, got "
                               f"{command!r}")
        result.append(argv)
    return result


def doc_pages(root: Path) -> list[Path]:
    """README.md, then every page under docs/, in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def markdown_links(path: Path) -> list[str]:
    """The targets of the page's Markdown links and images `[...](target)`, outside code blocks and code spans."""
    text = re.sub(r"^(`{3,})[^\n]*\n.*?^\1\s*$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
