"""Scrub a `--token` value from this process's command line before anything else runs: imported by
`phoenixft.cli`'s own `__init__`, which `python -m phoenixft ... --token T` and the `phoenixft` script reach
before any other module of theirs, so `ps` shows the token for the time the interpreter takes to start, not
for the imports and the flag parsing after it."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["scrub", "token_flag_value"]


def token_flag_value(argv: list[str]) -> str | None:
    """The value of `--token VALUE` or `--token=VALUE` in `argv` (None if there is none)."""
    for i, a in enumerate(argv):
        if a == "--token" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--token="):
            return a[len("--token="):]
    return None


def scrub(secret: str) -> bool:
    """Overwrite every occurrence of `secret` in this process's command line (what `ps` and /proc/PID/cmdline
    show) with '*', in place; False where that cannot be done (not Linux)."""
    if len(secret) < 4:
        return False
    try:
        with open("/proc/self/stat") as f:
            raw = f.read()
        fields = raw[raw.rfind(")") + 2:].split()  # fields[0] is field 3; arg_start, arg_end are fields 48, 49
        start, end = int(fields[45]), int(fields[46])
        area = ctypes.string_at(start, end - start)
    except (OSError, ValueError, IndexError):
        return False
    needle = secret.encode()
    scrubbed = area.replace(needle, b"*" * len(needle))
    if scrubbed != area:
        ctypes.memmove(start, scrubbed, len(scrubbed))
    return True


def _scrub_cli() -> None:
    argv = sys.argv
    if argv and (argv[0] in ("-m", "-c") or argv[0].endswith(("phoenixft", "__main__.py"))):  # (the CLI only)
        value = token_flag_value(argv)
        if value:
            scrub(value)


_scrub_cli()
