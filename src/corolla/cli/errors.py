"""What `corolla` tells a user whose command failed: one line on stderr that says what went wrong and what to do,
and the exit code, never a traceback (`corolla --debug ...` prints the traceback too).

`explain(error, args)` is a pure function of the exception (and the parsed arguments, to write the commands it
suggests with the user's own model and peers):

    what failed                                     exit   the line says
    argparse (bad flag, bad value, missing one)     2      the parser's message, a close flag, `--help`
    ValueError, FileNotFoundError (bad input)       2      the message (the commands word theirs for users)
    a port in use (ours or p2pd's)                  2      which address; another --port, or --port 0
    no initial peer answered                        1      the peers tried; is the swarm up, its address, swarm key
    MissingBlocks                                   1      which blocks; `corolla serve ... --blocks A:B`, `status`
    a model that cannot be loaded (OSError)         2      the model; a checkpoint directory or a reachable repo id
    another corolla error (a server failed)         1      the error; retry, or --debug
    anything else                                   1      the error; run again with --debug and report it
"""

from __future__ import annotations

import argparse
import difflib
import re

from corolla.protocol.errors import CorollaError, MissingBlocks

USAGE = 2  # the user's input is wrong: fix the command
FAILED = 1  # the command was fine, the world was not (the swarm, the network)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: the message, the closest option to an unknown one, and where
    the options are listed (argparse's default prints the whole usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = close_option(message, self._option_strings())
        self.exit(USAGE, f"{self.prog}: error: {message}{hint} (`{self.prog} --help` lists the options)\n")

    def _option_strings(self) -> list[str]:
        options = [s for action in self._actions for s in action.option_strings]
        for action in self._actions:  # unknown arguments are reported by the top parser: offer its commands' too
            if isinstance(action, argparse._SubParsersAction):
                options += [s for sub in action.choices.values() for a in sub._actions for s in a.option_strings]
        return options


def close_option(message: str, options: list[str]) -> str:
    """'; did you mean --blocks?' for the first unknown `--option` in argparse's `message` close to one of
    `options`, else ''."""
    found = re.match(r"unrecognized arguments: (.*)", message)
    unknown = [w.split("=")[0] for w in (found[1].split() if found else []) if w.startswith("--")]
    for word in unknown:
        close = difflib.get_close_matches(word, sorted(set(options)), n=1, cutoff=0.75)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


def explain(error: BaseException, args: argparse.Namespace | None = None) -> tuple[str, int]:
    """(one line for the user, exit code) for an exception a command raised (module docstring)."""
    text = one_line(error)
    command = getattr(args, "command", None) or "corolla"
    model = getattr(args, "model", None) or "MODEL"
    peers = ",".join(getattr(args, "initial_peers", None) or []) or "ADDR"
    if re.search(r"address already in use", text, re.IGNORECASE):
        where = re.search(r"(?:listen (?:tcp[46]? )?|listen on )(\S+?):? (?:bind|Address)", text)
        address = where[1] if where else "that address"
        return (f"cannot listen on {address}: the port is in use (another corolla, or another program). Choose "
                "another --port, or --port 0 to let the system pick a free one", USAGE)
    if re.search(r"bootstrap (peers|failed)|none of the initial peers answered", text):
        return (f"could not reach any initial peer ({peers}). Is the swarm running, and is that the current "
                "multiaddr of one of its peers (`corolla dht` and `corolla serve` print theirs)? A private swarm also "
                "needs its --swarm-key", FAILED)
    if isinstance(error, MissingBlocks):
        missing = block_spans(error.blocks)
        serve = f"corolla serve {model} --initial-peers {peers}" + (
            f" --blocks {missing[0]}" if len(missing) == 1 else "")
        return (f"{text}. Start a server for them (`{serve}`), or see which blocks the swarm holds with "
                f"`corolla status --initial-peers {peers} --model {model}`", FAILED)
    if isinstance(error, (ValueError, FileNotFoundError)):
        return text, USAGE
    if isinstance(error, OSError) and _is_model_error(text):
        return (f"cannot load the model {model}: {text}. Give a checkpoint directory (with config.json) or a "
                "Hugging Face repo id this machine can download", USAGE)
    if isinstance(error, CorollaError):
        return (f"{text} (the swarm failed this request: try again; `corolla {command} --help` lists the timeouts, "
                "and `corolla --debug ...` shows where it failed)", FAILED)
    return (f"{type(error).__name__}: {text} (unexpected: run `corolla --debug {command} ...` for the traceback, and "
            "report it)", FAILED)


def one_line(error: BaseException) -> str:
    """The error's message on one line: its first non-empty line (library messages can be paragraphs), with the
    date and time p2pd prefixes its own messages with dropped."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", text).rstrip(".")


def _is_model_error(text: str) -> bool:
    return bool(re.search(r"repo|model|config|tokenizer|huggingface|hub|not a (local )?(folder|directory)", text,
                          re.IGNORECASE))


def block_spans(blocks: list[int]) -> list[str]:
    """[0, 1, 2, 5] -> ['0:3', '5:6'] (half-open, as --blocks takes them)."""
    runs: list[list[int]] = []
    for block in sorted(set(blocks)):
        if runs and runs[-1][1] == block:
            runs[-1][1] = block + 1
        else:
            runs.append([block, block + 1])
    return [f"{a}:{b}" for a, b in runs]
