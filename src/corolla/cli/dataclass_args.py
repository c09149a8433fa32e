"""Generate argparse options from a frozen config dataclass, so defaults live in one place (the dataclass)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from corolla.cli.common import add_initial_peers_argument

T = TypeVar("T")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One option per field: `--field-name`, typed from the annotation, help and default from the field."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        meta = dict(field.metadata)
        help_text = str(meta.get("help", ""))
        base, optional = _base_type(hints[field.name])
        kwargs: dict[str, Any] = {}
        if meta.get("positional"):
            parser.add_argument(field.name, type=base, help=help_text)
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.name == "initial_peers":  # every command's --initial-peers is declared in one place
            add_initial_peers_argument(parser, help_text)
            continue
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(base) is tuple or base is tuple:
            kwargs["nargs"] = meta.get("nargs", "+")
            kwargs["type"] = str
        else:
            kwargs["type"] = base
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        shown = "" if default in (None, (), False) else f" (default: {default})"
        parser.add_argument(flag, dest=field.name, default=argparse.SUPPRESS, help=help_text + shown, **kwargs)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build the dataclass from parsed args; fields the user did not give keep the dataclass default."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    for key, value in values.items():
        if isinstance(value, list):
            values[key] = tuple(value)
    values.update(overrides)
    return cls(**values)


def _base_type(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False
