"""`--config job.toml`: every flag of `phoenixft run`, `launch`, `coordinator`, `chaos` and `agent` as a TOML key.

A run flag is a key of its config section, named as its field (`[training] steps = 100`, `[control]
fence_kill = false` for `--no-fence-kill`); the flags a command has of its own are keys of the command's
section (`[run] dry_run`, `[launch] head`, `[coordinator] host`, `[chaos] faults`, every flag of `[agent]`),
named as the flag without its dashes (`--token-file`: `token_file`); `launch`'s script and its arguments stay
on the command line. The command line overrides the file (a repeatable flag given on it, `--inject`, replaces
the file's list); the file overrides the defaults. A key the command does
not have, a value of the wrong type, a key outside any section are refused in one line that names the
file, the key and what is valid; a job token is never read from or written to a config file (`token_file`,
or $PHOENIXFT_TOKEN). `--print-config` writes the effective configuration as such a file, every key with its
help as a comment. Python's `tomllib` reads the file; `dump` is the small writer of flat sections of
scalars and lists that the effective file needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import textwrap
import tomllib
from dataclasses import dataclass
from typing import Any

from phoenixft.config.run import SECTIONS
from phoenixft.errors import UserError

__all__ = ["add_config_arguments", "use_config_file", "print_config", "flag_table", "load", "dump", "FlagKey"]

_SECTION_OF = {f.name: attr for attr, cls, _ in SECTIONS for f in dataclasses.fields(cls)}
_NOT_IN_FILES = {"token": "a job token does not belong in a config file (files are copied, shared and committed): "
                          "give token_file, or $PHOENIXFT_TOKEN"}
_OWN = ("help", "config", "print_config")  # (this module's own flags: never keys)


@dataclass(frozen=True)
class FlagKey:
    """One flag of a command as a config-file key: its section, its key, the argparse action behind it."""

    section: str
    key: str
    action: argparse.Action

    @property
    def kind(self) -> type:
        """The type a value of the key must have: bool, int, float, str, or list (of str)."""
        a = self.action
        if isinstance(a, argparse._AppendAction):
            return list
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction):
            return bool
        return a.type if a.type in (int, float) else str


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """`--config` and `--print-config` on a command's parser."""
    p.add_argument("--config", default="", metavar="PATH",
                   help="read flags from this TOML file, by section ([training] steps = 100, [control] "
                        "failure_timeout = 30, the command's own flags under [run], [coordinator], [chaos] or "
                        "[agent]); flags on the command line override it. `--print-config` writes one.")
    p.add_argument("--print-config", dest="print_config", action="store_true",
                   help="print the effective configuration (defaults, --config file, command line) as a TOML "
                        "file for --config, and start nothing")


def flag_table(parser: argparse.ArgumentParser, command: str) -> dict[tuple[str, str], FlagKey]:
    """(section, key) -> FlagKey for every flag of `parser` (the parser of `command`), in --help order."""
    out: dict[tuple[str, str], FlagKey] = {}
    for a in parser._actions:
        if a.dest in _OWN or not a.option_strings or a.help == argparse.SUPPRESS:  # (torchrun's aliases: no keys)
            continue
        if a.dest in _SECTION_OF and command != "agent":
            section, key = _SECTION_OF[a.dest], a.dest
        else:
            long = next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
            section, key = command, long.lstrip("-").replace("-", "_")
        out[(section, key)] = FlagKey(section, key, a)
    return out


def _typed(path: str, fk: FlagKey, value: Any) -> Any:
    """`value` as the flag takes it; UserError naming the file, the key and the type wanted."""
    kind = fk.kind
    where = f"{path}: [{fk.section}] {fk.key} = {_literal(value)} is invalid"
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if kind is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
              list: "a list of strings"}[kind]
    raise UserError(f"{where}: expected {wanted} (the flag {fk.action.option_strings[0]})")


def _literal(value: Any) -> str:
    try:
        return _value(value)
    except TypeError:
        return repr(value)


def load(path: str, table: dict[tuple[str, str], FlagKey]) -> dict[str, Any]:
    """dest -> typed value of every key of the file at `path`; UserError (one line) for anything the command does
    not take."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise UserError(f"--config={path!r} cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--config={path!r} is not valid TOML: {e}") from None
    sections = list(dict.fromkeys(s for s, _ in table))
    owner = {k: s for s, k in table}
    out: dict[str, Any] = {}
    for name, body in data.items():
        if not isinstance(body, dict):
            hint = f": it belongs in [{owner[name]}]" if name in owner else ""
            raise UserError(f"{path}: key {name!r} is outside any section{hint} (sections: {', '.join(sections)})")
        if name not in sections:
            raise UserError(f"{path}: unknown section [{name}] (valid sections here: {', '.join(sections)})")
        for key, value in body.items():
            if key in _NOT_IN_FILES:
                raise UserError(f"{path}: [{name}] {key}: {_NOT_IN_FILES[key]}")
            fk = table.get((name, key))
            if fk is None:
                valid = ", ".join(k for s, k in table if s == name and k not in _NOT_IN_FILES)
                hint = f" (it belongs in [{owner[key]}])" if key in owner else ""
                raise UserError(f"{path}: [{name}] has no key {key!r}{hint}; valid keys of [{name}]: {valid}")
            out[fk.action.dest] = _typed(path, fk, value)
    return out


def use_config_file(sub: argparse.ArgumentParser, command: str, path: str) -> dict[str, Any]:
    """The --config file at `path` as the defaults of `sub` (the parser of `command`): the command line, parsed
    afterwards, overrides them, and a flag the file gives is no longer required there. Returns the file's
    repeatable flags (dest -> list), which the caller applies where the command line gave none (argparse would
    append to them instead)."""
    table = flag_table(sub, command)
    values = load(path, table)
    lists = {fk.action.dest: values[fk.action.dest] for fk in table.values()
             if fk.kind is list and fk.action.dest in values}
    sub.set_defaults(**{d: v for d, v in values.items() if d not in lists})
    for a in sub._actions:
        if a.dest in values:
            a.required = False
    return lists


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _value(v: Any) -> str:
    """One TOML value: a bool, an integer, a float (inf and nan too), a string, or a list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in v) + '"'  # (a basic string: any character but these, as it is)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def dump(sections: dict[str, list[tuple[str, Any, str]]]) -> str:
    """TOML text of flat sections: {section: [(key, value, comment), ...]}; a None value is left out (its key
    commented), each comment written above its key."""
    lines: list[str] = []
    for name, items in sections.items():
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        for key, value, comment in items:
            for c in textwrap.wrap(comment, 100) if comment else []:
                lines.append(f"# {c}")
            lines.append(f"{key} = {_value(value)}" if value is not None else f"# {key} = (not set)")
    return "\n".join(lines) + "\n"


def print_config(sub: argparse.ArgumentParser, command: str, args: argparse.Namespace) -> str:
    """The effective configuration of `args` (a `command`'s parsed flags) as a --config file."""
    sections: dict[str, list[tuple[str, Any, str]]] = {}
    for (section, key), fk in flag_table(sub, command).items():
        value = getattr(args, fk.action.dest, None)
        if key in _NOT_IN_FILES:
            continue
        if fk.kind is list and value is None:
            value = []
        help_text = (fk.action.help or "").replace("%%", "%")
        sections.setdefault(section, []).append((key, value, f"{fk.action.option_strings[0]}: {help_text}"))
    return dump(sections)
