"""How a config section declares its flags: each field's metadata is its command-line flag.

A section is a dataclass whose fields are made with `option(default, help, ...)`: the help text is the
flag's `--help` line, `flag=` overrides the flag's name (default: `--` + the field name with dashes),
`action=` is argparse's (`store_true`, `store_false`, `append`; `both`: `--FLAG` and `--no-FLAG`);
`cli=False`: a field no command line sets directly (another command fills it in).
`add_section_arguments` turns one section into one argparse argument group; nothing else declares a
run flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection
from typing import Any

__all__ = ["option", "flag_of", "add_section_arguments"]


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its flag's help text (and `flag=`, `action=` when not the plain default)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def flag_of(f: dataclasses.Field[Any]) -> str:
    """The command-line flag of a config field."""
    return str(f.metadata.get("flag", "--" + f.name.replace("_", "-")))


def add_section_arguments(group: argparse._ActionsContainer, section: type, defaults: dict[str, Any],
                          exclude: Collection[str] = ()) -> None:
    """One flag per field of the dataclass `section` (except `exclude`) on `group`, with `defaults`
    overriding the fields' own defaults; each field's help text becomes its --help line."""
    for f in dataclasses.fields(section):
        if f.name in exclude or f.metadata.get("cli", True) is False:
            continue
        text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
        flag = flag_of(f)
        default = defaults.get(f.name, f.default)
        action = f.metadata.get("action")
        if action == "both":  # --flag and --no-flag
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif action in ("store_true", "store_false"):
            group.add_argument(flag, dest=f.name, action=action, default=default, help=text)
        elif action == "append":
            group.add_argument(flag, dest=f.name, action="append", default=None, metavar="SPEC", help=text)
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            group.add_argument(flag, dest=f.name, type=typ, default=default, help=f"{text} (default: {default!r})")
