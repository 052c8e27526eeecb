"""`--set MODULE.NAME=VALUE`: module switches set before a benchmark builds anything (A/B runs in one process)."""

from __future__ import annotations

import argparse
import ast
import importlib


def add_set_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help=f"set a module switch first, e.g. {example} (repeatable; the value is a Python literal)")


def apply_sets(parser: argparse.ArgumentParser, items: list[str]) -> None:
    """Sets each `MODULE.NAME=VALUE` of `items`; a name the module lacks is a usage error, not a new attribute."""
    for item in items:
        target, sep, value = item.partition("=")
        module, _, name = target.rpartition(".")
        if not sep or not module:
            parser.error(f"--set {item}: expected MODULE.NAME=VALUE")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            parser.error(f"--set {item}: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"{target} = {getattr(mod, name)!r}", flush=True)
