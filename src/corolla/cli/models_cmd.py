"""`corolla models`: which backend serves which HF model types, and why others are refused (the README's list)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="list the supported model types and backends",
        description="Print, as a Markdown table, our own block families and their model types, the model types the "
                    "generic backend (the installed transformers' decoder layers) is checked on, and example "
                    "refusals with the reasons the code gives for the installed transformers.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from corolla.models.registry import models_table

    print(models_table())
    return 0
