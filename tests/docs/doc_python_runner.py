"""Runs one page's Python snippets in order, in one namespace, as a reader pasting them into one interpreter would.

    python doc_python_runner.py RESULT_FD

Reads one JSON request per line on stdin: {"origin": "docs/x.md:12", "code": "..."} runs the code (compiled with its
origin as the file name, so a traceback names the page and line), {"set": {NAME: value}} sets names in the
namespace. Answers each with one JSON line on file descriptor RESULT_FD: {"ok": true} or {"ok": false, "error":
traceback}. What the snippets print goes to stdout/stderr (the test's log of the page). At end of input it shuts
down every corolla model the snippets left in the namespace (their DHT nodes and p2pd) and exits.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> int:
    results = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    namespace: dict[str, object] = {"__name__": "__main__"}
    namespace.update(json.loads(os.environ["DOC_SNIPPET_NAMES"]))
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if "set" in request:
                namespace.update(request["set"])
                results.write(json.dumps({"ok": True}) + "\n")
                continue
            try:
                exec(compile(request["code"], request["origin"], "exec"), namespace)
                sys.stdout.flush()
                results.write(json.dumps({"ok": True}) + "\n")
            except BaseException:  # the test reports it, with the snippet's page and line
                sys.stdout.flush()
                results.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
    finally:
        for value in list(namespace.values()):
            if type(value).__module__.startswith("corolla.") and callable(getattr(value, "shutdown", None)):
                try:
                    value.shutdown()
                except Exception:  # the test kills the process group anyway
                    traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
