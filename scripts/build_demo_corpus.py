#!/usr/bin/env python3
"""Build the offline English corpus used to train corolla's embedded demo model.

Sources, all already present on a typical Debian/Ubuntu machine with Python installed:

* man pages (sections 1-8, English only) rendered to plain text with ``groff``;
* docstrings of the Python standard library (modules, public classes, functions, methods);
* ``pydoc_data.topics.topics`` (the language-reference topics behind ``help()``);
* Debian's licence texts under ``/usr/share/common-licenses``.

Every document is normalised (one paragraph per line, collapsed whitespace, ASCII punctuation),
paragraphs longer than a short heading are deduplicated across the whole corpus, and the result is
written as one UTF-8 file where documents are separated by a blank line. Man pages, the largest
source, are sampled deterministically to keep the corpus near ``--target-mb``.

Usage::

    python scripts/build_demo_corpus.py --out /tmp/corpus.txt
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import importlib
import inspect
import io
import pkgutil
import random
import re
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MAN_ROOT = Path("/usr/share/man")
LICENSE_ROOT = Path("/usr/share/common-licenses")
# Thousands of near-identical generated pages would drown everything else.
MAN_SKIP_PREFIXES = ("gcloud",)
# Stdlib modules that are huge test suites, GUIs, or have side effects on import.
STDLIB_SKIP = {
    "test", "idlelib", "tkinter", "turtle", "turtledemo", "antigravity", "this", "lib2to3",
    "ensurepip", "pydoc_data", "__main__", "__phello__", "__hello__", "_pydev_bundle",
}
MIN_DEDUP_CHARS = 40

_PUNCT = str.maketrans({
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "--", "\u2212": "-",
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u00b4": "'", "\u2022": "*",
    "\u00a0": " ", "\u2002": " ", "\u2003": " ", "\u2009": " ", "\u00ad": "", "\u200b": "",
    "\u27e8": "<", "\u27e9": ">", "\u2026": "...",
})
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SPACES = re.compile(r"\s+")


def normalise(text: str, headings: bool = False) -> list[str]:
    """Return the paragraphs of ``text``, each joined onto one line with collapsed whitespace.

    Paragraphs are separated by blank lines. With ``headings`` (rendered man pages), an unindented
    line is a section heading and becomes a paragraph of its own.
    """
    text = _CONTROL.sub("", text.translate(_PUNCT))
    paragraphs: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            joined = _SPACES.sub(" ", " ".join(current)).strip()
            if joined:
                paragraphs.append(joined)
            current.clear()

    for line in text.splitlines():
        if not line.strip():
            flush()
        elif headings and not line[0].isspace():
            flush()
            current.append(line)
            flush()
        else:
            current.append(line)
    flush()
    return paragraphs


# ---------------------------------------------------------------------------------------------
# Man pages
# ---------------------------------------------------------------------------------------------

def list_man_pages() -> list[Path]:
    """English man pages in sections 1-8 (plain files, symlinks and skipped families excluded)."""
    pages = []
    for section in range(1, 9):
        folder = MAN_ROOT / f"man{section}"
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.is_symlink() or not path.is_file() or path.name.startswith(MAN_SKIP_PREFIXES):
                continue
            pages.append(path)
    return pages


def render_man_page(path: Path) -> list[str]:
    """Render one man page with groff to plain text; return its paragraphs (empty on failure)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except OSError:
        return []
    if raw.lstrip().startswith(b".so "):  # a redirect to another page, rendered on its own
        return []
    cmd = ["groff", "-k", "-Tutf8", "-mandoc", "-P", "-cbou", "-rLL=200n", "-rHY=0"]
    try:
        proc = subprocess.run(cmd, check=False, input=raw, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = proc.stdout.decode("utf-8", "replace").splitlines()
    content = [i for i, line in enumerate(lines) if line.strip()]
    if len(content) < 4:
        return []
    # Drop the running header ("LS(1)  User Commands  LS(1)") and footer lines.
    body = "\n".join(lines[content[0] + 1:content[-1]])
    return normalise(body, headings=True)


def man_documents() -> list[list[str]]:
    """All renderable man pages, as lists of paragraphs."""
    pages = list_man_pages()
    print(f"man: rendering {len(pages)} pages", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=4) as pool:
        docs = list(pool.map(render_man_page, pages, chunksize=16))
    return [d for d in docs if d]


# ---------------------------------------------------------------------------------------------
# Python standard library
# ---------------------------------------------------------------------------------------------

def stdlib_module_names() -> list[str]:
    """Importable stdlib modules and submodules, skipping tests, GUIs and side-effect modules."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in STDLIB_SKIP:
            continue
        names.add(top)
        with contextlib.suppress(Exception):
            module = _quiet_import(top)
            if module is not None and hasattr(module, "__path__"):
                for info in pkgutil.walk_packages(module.__path__, prefix=top + "."):
                    parts = info.name.split(".")
                    if any(p.startswith(("_", "test")) or p in STDLIB_SKIP for p in parts):
                        continue
                    names.add(info.name)
    return sorted(names)


def _quiet_import(name: str):
    """Import a module with its warnings and stdout/stderr output suppressed; None on failure."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - some modules raise SystemExit or odd errors
            return None


def _own_doc(obj) -> str | None:
    """The docstring defined on ``obj`` itself (not inherited), cleaned of indentation."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def docstring_documents() -> list[list[str]]:
    """One document per stdlib module: its docstring followed by its public members' docstrings."""
    warnings.simplefilter("ignore", DeprecationWarning)
    docs = []
    for name in stdlib_module_names():
        module = _quiet_import(name)
        if module is None:
            continue
        parts = []
        if doc := _own_doc(module):
            parts.append(doc)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            if doc := _own_doc(obj):
                parts.append(doc)
            if inspect.isclass(obj):
                for meth_name, meth in sorted(vars(obj).items()):
                    if meth_name.startswith("_") and meth_name != "__init__":
                        continue
                    meth = getattr(meth, "__func__", meth)
                    if (callable(meth) or isinstance(meth, property)) and (doc := _own_doc(meth)):
                        parts.append(doc)
        paragraphs = [p for part in parts for p in normalise(part)]
        if paragraphs:
            docs.append(paragraphs)
    return docs


def pydoc_topic_documents() -> list[list[str]]:
    """The language-reference topics that ``help()`` shows, one document each."""
    from pydoc_data.topics import topics

    return [p for p in (normalise(topics[key]) for key in sorted(topics)) if p]


def licence_documents() -> list[list[str]]:
    """Debian's common licence texts, one document each (symlinked duplicates skipped)."""
    if not LICENSE_ROOT.is_dir():
        return []
    docs = []
    for path in sorted(LICENSE_ROOT.iterdir()):
        if path.is_file() and not path.is_symlink():
            docs.append(normalise(path.read_text("utf-8", "replace")))
    return [d for d in docs if d]


# ---------------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------------

def dedupe(docs: list[list[str]], seen: set[bytes]) -> list[list[str]]:
    """Drop paragraphs already seen anywhere in the corpus (short headings are always kept)."""
    out = []
    for doc in docs:
        kept = []
        for para in doc:
            if len(para) >= MIN_DEDUP_CHARS:
                digest = hashlib.blake2b(para.lower().encode(), digest_size=16).digest()
                if digest in seen:
                    continue
                seen.add(digest)
            kept.append(para)
        if sum(len(p) for p in kept if len(p) >= MIN_DEDUP_CHARS) >= 200:
            out.append(kept)
    return out


def doc_bytes(doc: list[str]) -> int:
    """Size of a document as it will be written."""
    return sum(len(p.encode()) + 1 for p in doc) + 1


def main() -> None:
    """Collect, deduplicate, sample and write the corpus."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output text file (keep it out of the repo)")
    parser.add_argument("--target-mb", type=float, default=6.0, help="approximate corpus size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    seen: set[bytes] = set()
    fixed = []
    for label, build in [("pydoc topics", pydoc_topic_documents), ("licences", licence_documents),
                         ("docstrings", docstring_documents)]:
        docs = dedupe(build(), seen)
        print(f"{label}: {len(docs)} documents, {sum(map(doc_bytes, docs)) / 1e6:.2f} MB",
              file=sys.stderr)
        fixed.extend(docs)

    man = dedupe(man_documents(), seen)
    print(f"man: {len(man)} documents, {sum(map(doc_bytes, man)) / 1e6:.2f} MB", file=sys.stderr)
    budget = int(args.target_mb * 1e6) - sum(map(doc_bytes, fixed))
    random.Random(args.seed).shuffle(man)
    chosen, size = [], 0
    for doc in man:
        if size + doc_bytes(doc) > budget:
            continue
        chosen.append(doc)
        size += doc_bytes(doc)

    docs = fixed + chosen
    random.Random(args.seed + 1).shuffle(docs)
    text = "\n\n".join("\n".join(doc) for doc in docs) + "\n"
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(docs)} documents ({len(chosen)} man pages), "
          f"{len(text.encode()) / 1e6:.2f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
