"""The names a documentation page gives to code, and which of them no longer exist (test_doc_names runs it).

Where a page names code, and how each name is checked (against code_index.CodeIndex, read with ast, and the real
argparse parsers of `corolla`):

    where                        what                                      must exist
    code span `...`              client/chain/chain.py, tests/net, *.py    the file or directory (under the root,
                                 globs and <placeholders> allowed           src/corolla or src), or a file of that name
                                 corolla.server.rpc.handler(.Name.member)  the module, the name in it, its member
                                 server.rpc.handler (a corolla package)    the same, as corolla.server.rpc.handler
                                 ClientConfig.verify_rate, ServerInfo.x    the class, and the attribute on it
                                 session.x, model.x                        an attribute of InferenceSession / the
                                                                           distributed model classes
                                 MissingBlocks, SetPush, ValueError        a name defined in corolla, a builtin, a
                                                                           library's the code uses, or EXTERNAL
                                 name(...), obj.name(kw=...)               a def of that name taking those keywords
                                 ClientConfig(field=...)                   the class, taking those keywords
                                 snake_case, x.snake_case, kw=             an identifier the code uses somewhere
                                 corolla CMD --flag ...                    the subcommand and each of its flags
                                 --flag (bare)                             a flag of some corolla command, else of
                                                                           the script the line names (any bench/ or
                                                                           scripts/ one if it names none)
                                 python bench/x.py --flag                  the script, and the flag in its source
                                 tests/x.py::test_name                     the file, and the test in it
    link [..](target)            ../src/corolla/...                        the file, relative to the page
    ```bash block                corolla CMD --flag, python x.py --flag    as for code spans
    ```python block              from corolla.x import Y; Y(kw=...)        the module, Y in it, Y's keywords
    ```text block, prose         something/like_this.py                    the file
    prose                        corolla.x.y                               as in a code span
    prose, code span             PROTOCOL_VERSION (N), protocol version N  N is corolla.protocol.PROTOCOL_VERSION
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from code_index import IDENTIFIER, PACKAGE, CodeIndex

# names of other libraries that pages may give bare (class-like names are otherwise checked against corolla's)
EXTERNAL = {"Trainer"}  # HF's training loop (docs/training.md): the code never uses it, users do
METRIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")  # Prometheus adds these to a metric's name
# how pages name the objects users hold: `session.x` is an attribute of one of these classes
OBJECTS = {"session": ("InferenceSession",), "model": ("DistributedModelForCausalLM", "DistributedModelMixin",
                                                        "DistributedModelForSequenceClassification")}
CODE_DIRS = {"src", "tests", "bench", "scripts", "docs"}
FENCE = re.compile(r"^(`{3,})([^`\s]*)\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PROSE_PY_PATH = re.compile(r"(?<![\w/.\-])((?:[\w.\-]+/)*[\w\-]+\.py)(?![\w/])")
PROSE_MODULE = re.compile(rf"(?<![\w./`-]){PACKAGE}(?:\.[A-Za-z_]\w*)+")  # corolla.x.y outside code spans
# what a page says the wire protocol's version is: `PROTOCOL_VERSION` (4), PROTOCOL_VERSION is 4, protocol version 4
PROTOCOL_VERSION_SAID = re.compile(r"PROTOCOL_VERSION`?\s*(?:\((\d+)\)|is (\d+)|= ?(\d+))|protocol version (\d+)")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
CALL = re.compile(r"^(?P<callee>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\((?P<args>.*)\)$")
OPERATOR = re.compile(r"^[();<>|&]+$")


@dataclass(frozen=True)
class Finding:
    page: str
    line: int
    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: `{self.name}`: {self.problem}"


class CliIndex:
    """Each `corolla` subcommand's option strings, from the parser `corolla` runs."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.global_options = {s for a in parser._actions for s in a.option_strings}
        self.commands: dict[str, set[str]] = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    self.commands[name] = {s for a in sub._actions for s in a.option_strings}

    def command_problems(self, argv: list[str]) -> list[str]:
        """argv after `corolla`: the subcommand exists and takes every flag given (global ones before it)."""
        problems, command = [], None
        for token in argv:
            word = token.strip("[]()|,.;:'\"`")
            if not word:
                continue
            if command is None:
                if word.startswith("-"):
                    if word.split("=")[0] not in self.global_options:
                        problems.append(f"`corolla` has no global option {word.split('=')[0]}")
                    continue
                if not re.fullmatch(r"[a-z][a-z0-9-]*", word):
                    return problems  # a placeholder such as COMMAND, or a variable
                if word not in self.commands:
                    return [*problems, f"`corolla` has no command {word!r} (it has {', '.join(sorted(self.commands))})"]
                command = word
            elif word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-[\d.]+", word):
                flag = word.split("=")[0]
                if flag not in self.commands[command]:
                    problems.append(f"`corolla {command}` has no option {flag}")
        return problems

    def any_command_has(self, flag: str) -> bool:
        return flag in self.global_options or any(flag in options for options in self.commands.values())


class PageChecker:
    """Finds every name a page gives that does not exist (module docstring)."""

    def __init__(self, code: CodeIndex, cli: CliIndex) -> None:
        self.code, self.cli = code, cli

    def check(self, page: str, text: str, page_dir: str = "") -> list[Finding]:
        """Every stale name of the Markdown `text` of `page`, in page order (page_dir: the page's directory, from the
        root, for relative links)."""
        findings: list[Finding] = []
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if fence is None:
                findings += self._prose(page, i + 1, lines[i], page_dir)
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == fence[1]), len(lines))
            block = lines[i + 1 : end]
            if fence[2] == "bash":
                findings += self._bash(page, i + 2, block)
            elif fence[2] == "python":
                findings += self._python(page, i + 2, block)
            else:
                for k, line in enumerate(block):
                    findings += [Finding(page, i + 2 + k, path, problem) for path in PROSE_PY_PATH.findall(line)
                                 if (problem := self.path_problem(path)) is not None]
            i = end + 1
        return findings

    # ------------------------------------------------------------------------------------------ where names are
    def _prose(self, page: str, number: int, line: str, page_dir: str) -> list[Finding]:
        found = []
        for span in CODE_SPAN.finditer(line):
            found += [Finding(page, number, span[2], p) for p in self.span_problems(span[2].strip(), line)]
        bare = CODE_SPAN.sub(" ", line)
        for target in LINK.findall(bare):
            if not re.match(r"^([a-z]+:|#)", target):
                path = (Path(page_dir) / target.split("#")[0]).as_posix()
                if (problem := self.code.file_problem(path, bases=("",))) is not None:
                    found.append(Finding(page, number, target, problem))
        for path in PROSE_PY_PATH.findall(LINK.sub(" ", bare)):
            if (problem := self.path_problem(path)) is not None:
                found.append(Finding(page, number, path, problem))
        for dotted in PROSE_MODULE.findall(LINK.sub(" ", bare)):
            if (problem := self.code.dotted_problem(dotted)) is not None:
                found.append(Finding(page, number, dotted, problem))
        version = self.code.modules[f"{PACKAGE}.protocol"].constants.get("PROTOCOL_VERSION")
        for said in PROTOCOL_VERSION_SAID.finditer(line):
            if int(next(g for g in said.groups() if g)) != version:
                found.append(Finding(page, number, said[0].replace("`", ""), f"the protocol version is {version}"))
        return found

    def _bash(self, page: str, first: int, block: list[str]) -> list[Finding]:
        found, pending, start = [], "", first
        for k, line in enumerate(block):
            if not pending:
                start = first + k
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command, pending = pending + line, ""
            for argv in _commands(command):
                found += [Finding(page, start, " ".join(argv), p) for p in self.argv_problems(argv)]
        return found

    def _python(self, page: str, first: int, block: list[str]) -> list[Finding]:
        try:
            tree = ast.parse("\n".join(block))
        except SyntaxError:
            return []  # not Python as written; the snippet test runs the blocks that are meant to run
        found, imported = [], {}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
                names = [f"{node.module}.{a.name}" for a in node.names]
                imported.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
            for name in names:
                if (problem := self.code.dotted_problem(name)) is not None:
                    found.append(Finding(page, first + node.lineno - 1, name, problem))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
                keywords = [k.arg for k in node.keywords if k.arg]
                problem = self._keywords_problem(imported[node.func.id].split(".")[-1], keywords)
                if problem is not None:
                    found.append(Finding(page, first + node.lineno - 1, ast.unparse(node)[:80], problem))
        return found

    # ------------------------------------------------------------------------------------------ what names are
    def span_problems(self, span: str, line: str = "") -> list[str]:
        """What is missing of the code span `span` (found on `line`), by what it looks like; [] if all exists."""
        if not span or span[0] in "/~$\"'{<#.:" or re.match(r"^[a-z]+://", span):
            return []
        span = span.removeprefix("with ")
        words = span.split()
        if words[0] == PACKAGE and len(words) > 1:
            return self.cli.command_problems(words[1:])
        if words[0].split("/")[-1].startswith(("python", "sudo")) or words[0].endswith(".py"):
            return self.argv_problems([w.strip("[]") for w in words])
        if words[0] == "make" and len(words) > 1:
            return self._make_problems(words[1:])
        if (assigned := re.fullmatch(r"([\w.]+)\s*=\s*\S.*", span)) is not None and DOTTED.match(assigned[1]):
            return self._dotted_problems(assigned[1].split("."))  # session.position = p
        if words[0].startswith("--") or re.fullmatch(r"-[a-zA-Z]", words[0]):
            return self._flag_problems([w for w in words if w.startswith("--")], line)
        if (call := CALL.match(span)) is not None:
            return self._call_problems(call["callee"], call["args"])
        if len(words) > 1:
            return []  # prose, an HTTP route, a log line: not a name
        if re.fullmatch(r"[A-Za-z_]\w*=.*", span):
            name = span.split("=")[0]
            return [] if name in self.code.identifiers else [f"no code uses the name {name}"]
        if "::" in span:
            return self._test_id_problems(span)
        if "/" in span:
            return [p] if (p := self.path_problem(span)) is not None else []
        if span.endswith(".py"):
            return [p] if (p := self.code.file_name_problem(span)) is not None else []
        if re.search(r"\.(json|safetensors|bin|txt|md|ya?ml|toml)$", span):
            return []  # a file format's name (adapter_config.json): not necessarily one of ours
        if DOTTED.match(span):
            return self._dotted_problems(span.split("."))
        if IDENTIFIER.match(span):
            return self._bare_problems(span)
        return []

    def path_problem(self, path: str) -> str | None:
        """A path that names the repository's files (a .py file, or under a directory of code)."""
        if "/" not in path:
            return self.code.file_name_problem(path) if path.endswith(".py") else None
        if path.split("/")[0] in CODE_DIRS or path.split("/")[0] in _packages(self.code) or path.endswith(".py"):
            return self.code.file_problem(path)
        return None

    def argv_problems(self, argv: list[str]) -> list[str]:
        """A shell command: `corolla ...` checked by the CLI's parsers; `python SCRIPT.py --flag`: the script
        exists and holds each flag; `python -m pytest path::test`: the tests exist."""
        if not argv:
            return []
        if argv[0] == PACKAGE:
            return self.cli.command_problems(argv[1:])
        scripts = [w for w in argv if w.endswith(".py") or ".py::" in w]
        if not argv[0].split("/")[-1].startswith(("python", "sudo", "pytest")) and not argv[0].endswith(".py"):
            return []
        problems = []
        for given in scripts:
            if "::" in given:
                problems += self._test_id_problems(given)
                continue
            script = given  # bench_failover.py --flag: the script of that name
            if "/" not in given:
                script = next((f for f in self.code.sources if f.rsplit("/", 1)[-1] == given), given)
            if (problem := self.path_problem(script)) is not None:
                problems.append(problem)
            elif script.startswith(("bench/", "scripts/")):
                flags = [w.split("=")[0] for w in argv[argv.index(given) + 1 :] if w.startswith("--")]
                problems += [f"{script} takes no option {flag}" for flag in flags
                             if not self.code.defines_literal(script, flag)]
        return problems

    def _make_problems(self, targets: list[str]) -> list[str]:
        makefile = (self.code.root / "Makefile").read_text() if (self.code.root / "Makefile").exists() else ""
        return [f"the Makefile has no target {t}" for t in targets if re.fullmatch(r"[a-z][\w-]*", t)
                and not re.search(rf"^{re.escape(t)}\s*:", makefile, re.MULTILINE)]

    def _flag_problems(self, flags: list[str], line: str) -> list[str]:
        problems = []
        scripts = re.findall(r"((?:bench|scripts)/\w+\.py)", line)
        others = scripts or [f for f in self.code.sources if f.startswith(("bench/", "scripts/"))]
        for flag in (f.split("=")[0].strip(".,;:") for f in flags):
            if self.cli.any_command_has(flag) or any(self.code.defines_literal(s, flag) for s in others):
                continue
            problems.append(f"no `corolla` command takes {flag}" + (f" (nor {', '.join(scripts)})" if scripts else ""))
        return problems

    def _call_problems(self, callee: str, args: str) -> list[str]:
        parts = callee.split(".")
        try:
            call = ast.parse(f"f({args})", mode="eval").body
            keywords = [k.arg for k in call.keywords if k.arg] if isinstance(call, ast.Call) else []
        except SyntaxError:
            keywords = []  # `f(...)`, `f(a, b=...)`: placeholders
        if len(parts) == 1 and parts[0][0].isupper():
            return [p] if (p := self._keywords_problem(parts[0], keywords)) is not None else []
        if len(parts) == 1 and parts[0] in OBJECTS:
            return []  # model(ids, ...): the object called, its keywords are HF's
        problems = self._dotted_problems(parts) if len(parts) > 1 else self._bare_problems(parts[0], called=True)
        if not problems and keywords:
            problems += [p] if (p := self._keywords_problem(parts[-1], keywords)) is not None else []
        return problems

    def _keywords_problem(self, name: str, keywords: list[str]) -> str | None:
        """`name(**keywords)`: some class or def of that name takes every one of them."""
        if name[0].isupper():
            classes = self.code.classes.get(name, [])
            if not classes:
                return None if name in EXTERNAL else self.code.class_problem(name)
            accepted = [self.code.keywords(c) for c in classes]
        else:
            accepted = self.code.function_keywords(name)
        if not keywords or not accepted or any(a is None for a in accepted):
            return None
        for keyword in keywords:
            if not any(keyword in a for a in accepted if a is not None):
                return f"{name} takes no keyword {keyword}"
        return None

    def _dotted_problems(self, parts: list[str]) -> list[str]:
        head = parts[0]
        if head == PACKAGE:
            problem = self.code.dotted_problem(".".join(parts))
        elif head in _packages(self.code) and f"{PACKAGE}.{head}.{parts[1]}" in self.code.modules:
            problem = self.code.dotted_problem(".".join([PACKAGE, *parts]))
        elif head[0].isupper() and head in self.code.classes:
            problem = self.code.member_problem(head, parts[1])
        elif head[0].isupper() and head not in EXTERNAL and head.upper() != head:
            problem = self.code.class_problem(head)
        elif head in OBJECTS:
            found = [self.code.member_problem(c, parts[1]) for c in OBJECTS[head] if c in self.code.classes]
            problem = None if any(p is None for p in found) or not found else f"a {head} has no attribute {parts[1]}"
        else:
            missing = [p for p in parts[1:] if p not in self.code.identifiers]
            problem = f"no code uses the name {missing[0]}" if missing else None
        return [problem] if problem is not None else []

    def _bare_problems(self, name: str, called: bool = False) -> list[str]:
        if name[0].isupper() and name.upper() != name:  # a class-like name (MODEL, PEERS: placeholders)
            return [] if name in EXTERNAL else [p] if (p := self.code.class_problem(name)) is not None else []
        if called and "_" in name:  # ours, or another library's method the code calls (apply_chat_template)
            known = name in self.code.functions or name in self.code.foreign
            return [] if known else [f"no function or method named {name}"]
        if "_" in name.strip("_") or name.startswith("_"):
            base = next((name.removesuffix(s) for s in METRIC_SUFFIXES if name.endswith(s)), name)
            return [] if name in self.code.identifiers or base in self.code.identifiers else [
                f"no code uses the name {name}"]
        return []  # a plain word (llama, none, slow): not distinguishable from prose

    def _test_id_problems(self, node_id: str) -> list[str]:
        path, _, test = node_id.partition("::")
        if (problem := self.code.file_problem(path)) is not None:
            return [problem]
        name = re.split(r"[\[:]", test)[0]
        if name and not re.search(rf"\b(def|class) {re.escape(name)}\b", self.code.sources.get(path, "")):
            return [f"{path} has no test {name}"]
        return []


def _packages(code: CodeIndex) -> set[str]:
    return {m.split(".")[1] for m in code.modules if m.count(".") >= 1}


def _commands(command: str) -> list[list[str]]:
    """The argv of each `corolla` or `python`-like command in one shell line (pipes, &&, $( ) and ; split it)."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.commenters, lexer.whitespace_split = "#", True
        tokens = list(lexer)
    except ValueError:
        tokens = command.split()
    result, current = [], None
    for token in tokens:
        if OPERATOR.match(token) or token.startswith("$("):
            current = None
            token = token[2:] if token.startswith("$(") else ""
            if not token:
                continue
        name = token.split("/")[-1]
        if current is None and (token == PACKAGE or name.startswith(("python", "pytest"))):
            current = [token if token == PACKAGE else name]
            result.append(current)
        elif current is not None:
            current.append(token)
    return result
