"""What exists in the repository, read with `ast` (nothing of corolla is imported): its files, corolla's modules,
their top-level names, classes with their members and keyword parameters, functions with theirs, and every
identifier the code uses. The docs-names test (test_doc_names) asks it whether a name a page gives still exists.

Each `*_problem` method returns None when the name exists, else one line saying what is missing.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "corolla"
CODE_DIRS = ("src", "tests", "bench", "scripts")  # whose Python files make the identifier universe
SELF = "tests/docs/"  # the docs' own tests: the stale names their examples give must not count as code
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FIELD_BASES = {"BaseModel", "NamedTuple", "TypedDict"}  # classes whose annotated body lines are keyword parameters


@dataclass
class ClassInfo:
    module: str
    name: str
    members: set[str]  # body definitions and assignments, self.X assignments in its methods
    bases: list[str]  # each base as written, e.g. "_Message", "nn.Module"
    init_params: list[str] | None  # its own __init__'s keywords (None: none of its own, or it takes **kwargs)
    has_init: bool
    fields: list[str]  # annotated body lines (dataclass, pydantic and NamedTuple fields)
    is_dataclass: bool


@dataclass
class ModuleInfo:
    name: str
    path: Path
    names: set[str]  # bound at top level (including under if/try), plus __all__
    imports: dict[str, str]  # local name -> the dotted name it was imported as
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    constants: dict[str, object] = field(default_factory=dict)  # NAME = literal at top level
    lazy: bool = False  # defines a module __getattr__: names beyond `names` may exist


class CodeIndex:
    """The repository at `root` as the docs test needs it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: set[str] = set()  # every file and directory, posix paths relative to root
        self.modules: dict[str, ModuleInfo] = {}
        self.classes: dict[str, list[ClassInfo]] = {}
        self.functions: dict[str, list[list[str] | None]] = {}  # def name (function or method) -> keyword params
        self.identifiers: set[str] = set(dir(builtins))
        self.foreign: set[str] = set(dir(builtins))  # names of other libraries the code uses: imported or attributes
        self.ignored = _ignored_dirs(root)  # outputs (.gitignore): a page may name them, they need not exist now
        self.sources: dict[str, str] = {}  # posix path -> text, of every Python file read
        self._walk()

    # ------------------------------------------------------------------------------------------ building
    def _walk(self) -> None:
        for directory, dirs, files in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "site"))
            base = Path(directory).relative_to(self.root)
            for name in [*dirs, *files]:
                self.files.add((base / name).as_posix())
            for name in files:
                rel = (base / name).as_posix()
                if name.endswith(".py") and rel.split("/")[0] in CODE_DIRS:
                    self._read(rel)

    def _read(self, rel: str) -> None:
        text = (self.root / rel).read_text()
        self.sources[rel] = text
        if rel.startswith(SELF):
            return
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return
        for node in ast.walk(tree):
            self.identifiers.update(_identifiers(node))
            if isinstance(node, ast.Attribute):
                self.foreign.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] != PACKAGE and not node.level:
                self.foreign.update(alias.name for alias in node.names)
                self.identifiers.update((node.module or "").split("."))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(_params(node.args))
        if rel.startswith(f"src/{PACKAGE}/"):
            module = rel[len("src/"):-len(".py")].replace("/", ".").removesuffix(".__init__")
            self.modules[module] = info = _module_info(module, self.root / rel, tree)
            for cls in info.classes.values():
                self.classes.setdefault(cls.name, []).append(cls)

    # ------------------------------------------------------------------------------------------ questions
    def file_problem(self, path: str, *, bases: tuple[str, ...] = ("", f"src/{PACKAGE}/", "src/")) -> str | None:
        """`path` (a glob may hold * and <placeholders>) exists under the root, src/corolla or src."""
        pattern = re.sub(r"<[^>]*>", "*", path.rstrip("/"))
        if any(pattern == d or pattern.startswith(d + "/") for d in self.ignored):
            return None
        for base in bases:
            wanted = os.path.normpath(base + pattern).replace(os.sep, "/")
            if any(fnmatch.fnmatchcase(f, wanted) for f in self.files) if "*" in wanted else wanted in self.files:
                return None
        return f"no file or directory {path}"

    def file_name_problem(self, name: str) -> str | None:
        """A bare file name (a glob may hold *): some file of the repository has it."""
        pattern = re.sub(r"<[^>]*>", "*", name)
        if any(fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], pattern) for f in self.files):
            return None
        return f"no file named {name} in the repository"

    def dotted_problem(self, dotted: str) -> str | None:
        """`corolla.a.b.Name.member`: the longest module prefix exists, then each name in it (one member deep)."""
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            module = ".".join(parts[:k])
            if module in self.modules:
                return self._in_module(self.modules[module], parts[k:], dotted, depth=0)
        return f"no module {dotted}"

    def _in_module(self, module: ModuleInfo, rest: list[str], dotted: str, depth: int) -> str | None:
        if not rest:
            return None
        name = rest[0]
        if name in module.classes:
            return self.member_problem(module.classes[name], rest[1]) if len(rest) > 1 else None
        if name in module.imports and depth < 8:
            target = module.imports[name]
            if target.split(".")[0] != PACKAGE:
                return None  # a name from another library: not ours to check
            parts = target.split(".") + rest[1:]
            for k in range(len(parts), 0, -1):
                prefix = ".".join(parts[:k])
                if prefix in self.modules:
                    return self._in_module(self.modules[prefix], parts[k:], dotted, depth + 1)
            return f"{module.name} imports {name} from {target}, which does not exist"
        if name in module.names or module.lazy:
            return None
        return f"module {module.name} has no {name}"

    def class_problem(self, name: str) -> str | None:
        """A class-like name: defined in corolla, or another library's name the code uses (ValueError, Linear4bit)."""
        if name in self.classes or name in self.foreign or any(name in m.names for m in self.modules.values()):
            return None
        return f"nothing named {name} is defined in {PACKAGE}"

    def member_problem(self, cls: ClassInfo | str, member: str) -> str | None:
        """`member` is an attribute of the class (or of one of that name), inherited ones included."""
        candidates = [cls] if isinstance(cls, ClassInfo) else self.classes.get(cls, [])
        if not candidates:
            return self.class_problem(str(cls))
        if any(self._has_member(c, member, 0) for c in candidates):
            return None
        return f"{candidates[0].name} has no attribute {member}"

    def _has_member(self, cls: ClassInfo, member: str, depth: int) -> bool:
        if member in cls.members or depth > 8:
            return True
        return any(self._base_has(cls, base, member, depth) for base in cls.bases)

    def _base_has(self, cls: ClassInfo, base: str, member: str, depth: int) -> bool:
        module = self.modules[cls.module]
        head, _, tail = base.partition(".")
        target = module.imports.get(head, head if head in module.classes else f"builtins.{head}")
        if head in module.classes and not tail:
            return self._has_member(module.classes[head], member, depth + 1)
        dotted = f"{target}.{tail}" if tail else target
        if dotted.split(".")[0] == PACKAGE:
            found = self._class_at(dotted)
            return found is None or self._has_member(found, member, depth + 1)
        return _external_has(dotted, member)

    def _class_at(self, dotted: str) -> ClassInfo | None:
        module, _, name = dotted.rpartition(".")
        info = self.modules.get(module)
        if info is None:
            return None
        if name in info.classes:
            return info.classes[name]
        return self._class_at(info.imports[name]) if name in info.imports else None

    def keywords(self, cls: ClassInfo) -> list[str] | None:
        """What `cls(...)` accepts as keywords, or None when that cannot be told (external bases, **kwargs)."""
        if cls.has_init:
            return cls.init_params
        module = self.modules[cls.module]
        accepted = list(cls.fields)
        for base in cls.bases:
            head = base.split(".")[-1]
            if head in FIELD_BASES or head in ("object", "Protocol", "Generic"):
                continue
            parent = module.classes.get(base) or self._class_at(module.imports.get(base, ""))
            if parent is None:
                return None
            inherited = self.keywords(parent)
            if inherited is None:
                return None
            accepted += inherited
        if cls.is_dataclass or any(b.split(".")[-1] in FIELD_BASES for b in cls.bases) or accepted:
            return accepted
        return None

    def function_keywords(self, name: str) -> list[list[str] | None]:
        return self.functions.get(name, [])

    def defines_literal(self, rel: str, text: str) -> bool:
        """The Python file `rel` holds `text` inside a string literal (e.g. a script's argparse flag)."""
        return f'"{text}"' in self.sources.get(rel, "") or f"'{text}'" in self.sources.get(rel, "")


def _ignored_dirs(root: Path) -> set[str]:
    """The plain paths .gitignore lists (no globs): build and run outputs such as bench/results/."""
    ignore = root / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.exists() else []
    return {line.strip().strip("/") for line in lines if line.strip() and not re.search(r"[*?!#\[]", line)}


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.alias):
        return [node.asname or node.name.split(".")[-1], *node.name.split(".")]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 80:
        return re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value)
    return []


def _params(args: ast.arguments) -> list[str] | None:
    if args.kwarg is not None:
        return None
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in ("self", "cls")]


def _top_level(body: list[ast.stmt]):
    """The statements of a module body, looking inside if / try / with blocks (TYPE_CHECKING, optional imports)."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for inner in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top_level(inner)
        else:
            yield node


def _targets(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    names = []
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.append(sub.id)
    return names


def _module_info(name: str, path: Path, tree: ast.Module) -> ModuleInfo:
    info = ModuleInfo(name, path, set(), {})
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.names.add(node.name)
            info.lazy |= node.name == "__getattr__"
        elif isinstance(node, ast.ClassDef):
            info.names.add(node.name)
            info.classes[node.name] = _class_info(name, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                info.names.add(alias.asname or alias.name.split(".")[0])
                info.imports[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # from . import x, from ..y import x: relative to this module's package
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(parents + ([source] if source else []))
            for alias in node.names:
                info.names.add(alias.asname or alias.name)
                info.imports[alias.asname or alias.name] = f"{source}.{alias.name}"
        else:
            info.names.update(_targets(node))
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                info.constants.update({name: node.value.value for name in _targets(node)})
            if "__all__" in _targets(node) and isinstance(node.value, (ast.List, ast.Tuple)):
                info.names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return info


def _class_info(module: str, node: ast.ClassDef) -> ClassInfo:
    members: set[str] = set()
    fields: list[str] = []
    init_params: list[str] | None = None
    has_init = False
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(stmt.name)
            if stmt.name == "__init__" and isinstance(stmt, ast.FunctionDef):
                has_init, init_params = True, _params(stmt.args)
        members.update(_targets(stmt))
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and "ClassVar" not in ast.unparse(
                stmt.annotation):
            fields.append(stmt.target.id)
    for sub in ast.walk(node):  # self.x = ... / self.x: T = ... in any method
        for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                sub, (ast.AnnAssign, ast.AugAssign)) else []):
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id in (
                        "self", "cls"):
                    members.add(part.attr)
    is_dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    return ClassInfo(module, node.name, members, [ast.unparse(b) for b in node.bases], init_params, has_init, fields,
                     is_dataclass)


def _external_has(dotted: str, member: str) -> bool:
    """Whether another library's class `dotted` (e.g. "torch.nn.Module") has `member`; True when it cannot be
    imported here (then it is not ours to judge)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        try:
            for part in parts[k:]:
                obj = getattr(obj, part)
        except AttributeError:
            return True
        return hasattr(obj, member) or member in getattr(obj, "model_fields", {})
    return True
