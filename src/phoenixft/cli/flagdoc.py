"""The flag tables of docs/usage.md, written from the commands' own parsers.

    python -m phoenixft.cli.flagdoc              # check docs/usage.md: exit 1 naming each table that differs
    python -m phoenixft.cli.flagdoc --write      # rewrite its tables

Each table sits between `<!-- flags:NAME -->` and `<!-- /flags:NAME -->`; it lists every flag the parser has
(its default and its --help text), so the page cannot lack a flag or keep one that is gone
(tests/test_docs.py checks it).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["TABLES", "render", "check", "write", "USAGE"]

USAGE = Path(__file__).resolve().parents[3] / "docs" / "usage.md"
_BLOCK = re.compile(r"(<!-- flags:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /flags:(?P=name) -->)", re.S)
_SKIP = {"help", "config", "print_config"}  # (--config and --print-config: said once, above the tables)


def _sub(command: str) -> argparse.ArgumentParser:
    from phoenixft.cli.main import _subparser, build_parser

    return _subparser(build_parser(), command)


def _flags(a: argparse.Action) -> str:
    return ", ".join(f"`{o}`" for o in a.option_strings if o.startswith("--"))


def _default(a: argparse.Action) -> str:
    if isinstance(a, argparse._StoreTrueAction):
        return "off"
    if isinstance(a, argparse._StoreFalseAction):
        return "on"
    if isinstance(a, argparse.BooleanOptionalAction):
        return "on" if a.default else "off"
    if a.default in (None, "", [], argparse.SUPPRESS):
        return ""
    return f"`{a.default}`"


def _meaning(a: argparse.Action) -> str:
    text = (a.help or "").replace("%%", "%")
    auto = f" (default: {a.default!r})"  # (what the run flags' help adds: the default has its own column)
    if text.endswith(auto):
        text = text[: -len(auto)]
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _rows(actions: list[argparse.Action]) -> str:
    out = ["| flag | default | meaning |", "|---|---|---|"]
    out += [f"| {_flags(a)} | {_default(a)} | {_meaning(a)} |" for a in actions]
    return "\n".join(out) + "\n"


def _own(command: str) -> list[argparse.Action]:
    """The flags of `command` that are its own (not in a run-flag section's group)."""
    p = _sub(command)
    return [a for g in p._action_groups if g.title in ("options", "optional arguments") for a in g._group_actions
            if a.option_strings and a.dest not in _SKIP]


def _run() -> str:
    p = _sub("run")
    parts = []
    for g in p._action_groups:
        actions = [a for a in g._group_actions if a.option_strings and a.dest not in _SKIP]
        if not actions:
            continue
        title = "the command's own" if g.title in ("options", "optional arguments") else g.title
        parts.append(f"**{title}**\n\n" + _rows(actions))
    return "\n".join(parts)


def _chaos() -> str:
    """chaos's own flags, and the run flags whose default differs for a campaign."""
    run = {a.dest: a.default for a in _sub("run")._actions}
    own = {id(a) for a in _own("chaos")}
    differ = [a for a in _sub("chaos")._actions if a.option_strings and a.dest in run and a.dest not in _SKIP
              and id(a) not in own and a.default != run[a.dest]]
    return _rows(_own("chaos")) + "\nDefaults that differ from `phoenixft run`'s:\n\n" + _rows(differ)


def _all(command: str) -> Callable[[], str]:
    return lambda: _rows([a for a in _sub(command)._actions if a.option_strings and a.dest not in _SKIP])


TABLES: dict[str, Callable[[], str]] = {
    "run": _run,
    "coordinator": lambda: _rows(_own("coordinator")),
    "chaos": _chaos,
    "agent": _all("agent"),
    "status": _all("status"),
    "drain": _all("drain"),
}


def render(name: str) -> str:
    return TABLES[name]()


def check(path: Path = USAGE) -> list[str]:
    """The tables of `path` that differ from the parsers (or are missing)."""
    found = {m.group("name"): m.group("body") for m in _BLOCK.finditer(path.read_text())}
    bad = [f"{path.name}: no table <!-- flags:{n} -->" for n in TABLES if n not in found]
    bad += [f"{path.name}: the flags of `phoenixft {n}` differ from its parser (python -m phoenixft.cli.flagdoc "
            "--write)" for n, body in found.items() if n in TABLES and body != render(n)]
    return bad


def write(path: Path = USAGE) -> bool:
    text = path.read_text()
    new = _BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), text)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the tables of docs/usage.md")
    a = ap.parse_args(argv)
    if a.write:
        print("wrote" if write() else "unchanged", USAGE)
        return 0
    bad = check()
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
