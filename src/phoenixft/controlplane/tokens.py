"""The job token: where it comes from, how strong it must be, and keeping it off command lines.

A token comes from `--token-file PATH` (the file must be the user's and mode 0600 or stricter), the
environment (`PHOENIXFT_TOKEN`), or `--token` (shown by `ps` until the process scrubs it from its
command line, at once: `scrub_argv`; prefer the other two). It must carry MIN_TOKEN_BITS bits by
`token_bits`. A generated one (`generate_token`, 256 bits) is written to a new 0600 file
(`write_token_file`), never printed. Re-exported by `phoenixft.controlplane.auth`.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import secrets
import stat
from pathlib import Path

from phoenixft.errors import UserError

__all__ = ["TOKEN_ENV", "MIN_TOKEN_CHARS", "MIN_TOKEN_BITS", "MIN_DISTINCT", "resolve_token", "token_source",
           "read_token_file", "write_token_file", "generate_token", "token_bits", "check_token", "scrub_argv"]

TOKEN_ENV = "PHOENIXFT_TOKEN"
MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 128
MIN_DISTINCT = 8


def resolve_token(flag: str | None, token_file: str | None = None) -> str | None:
    """The token from `--token`, else from `--token-file` (checked: `read_token_file`), else from the
    environment (PHOENIXFT_TOKEN), else None."""
    if flag:
        scrub_argv(flag)  # (`ps` shows the command line: the token goes from it now)
        return flag
    if token_file:
        return read_token_file(token_file)
    return os.environ.get(TOKEN_ENV, "") or None


def token_source(flag: str | None, token_file: str | None = None) -> str:
    """What `resolve_token` took the token from, as an error message names it."""
    return "--token" if flag else f"--token-file={token_file}" if token_file else f"${TOKEN_ENV}"


def read_token_file(path: str, flag: str = "--token-file") -> str:
    """The token in the first line of `path`; UserError (one line) unless the file is this user's and
    readable by no one else (mode 0600 or stricter)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise UserError(f"{flag}={path}: cannot open it ({e.strerror})") from None
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
        st = os.fstat(f.fileno())
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid():
            raise UserError(f"{flag}={path}: the file belongs to uid {st.st_uid}, not to this user (uid "
                            f"{os.getuid()}); use a token file of your own with mode 0600")
        if mode & 0o077:
            raise UserError(f"{flag}={path}: mode {mode:04o} lets other users read the job token; run "
                            f"`chmod 600 {path}` (a token file must be readable by its owner only)")
        return f.readline().strip()


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to a new file at `path` readable by this user only (0600, created so: never wider)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def generate_token() -> str:
    return secrets.token_urlsafe(32)  # 256 bits


def token_bits(token: str) -> float:
    """The token's entropy as estimated from its character classes: length x log2(the size of the
    alphabet that the classes it uses span: lower 26, upper 26, digits 10, anything else 32)."""
    alphabet = sum(size for test, size in ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))
                   if any(test(c) and c.isascii() for c in token))
    alphabet += 32 if any(not (c.isascii() and c.isalnum()) for c in token) else 0
    return len(token) * math.log2(alphabet) if alphabet > 1 else 0.0


def check_token(token: str, source: str) -> str:
    """Raise UserError unless `token` is usable; `source` names where it came from (a flag or the env).

    The rule: at least MIN_TOKEN_CHARS characters, no whitespace, at least MIN_TOKEN_BITS bits by
    `token_bits`, at least MIN_DISTINCT distinct characters, and not one string repeated."""
    how = "make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
    if len(token) < MIN_TOKEN_CHARS or token != token.strip() or any(c.isspace() for c in token):
        raise UserError(f"{source} is invalid: a job token needs at least {MIN_TOKEN_CHARS} characters and no "
                        f"whitespace (got {len(token)} characters); {how}")
    bits, distinct = token_bits(token), len(set(token))
    weak = (f"{bits:.0f} bits" if bits < MIN_TOKEN_BITS else f"{distinct} distinct characters"
            if distinct < MIN_DISTINCT else "one string repeated" if token in (token + token)[1:-1] else "")
    if weak:
        raise UserError(f"{source} is too weak ({weak}): a job token needs {MIN_TOKEN_BITS} bits of entropy, "
                        f"estimated as length x log2(the alphabet its character classes span), at least "
                        f"{MIN_DISTINCT} distinct characters and no repeated pattern; {how}")
    return token


def _argv_area() -> tuple[int, int]:
    """Addresses [start, end) of this process's argv strings (/proc/self/stat fields 48 and 49)."""
    with open("/proc/self/stat") as f:
        raw = f.read()
    fields = raw[raw.rfind(")") + 2:].split()  # fields[0] is field 3
    return int(fields[45]), int(fields[46])


def scrub_argv(secret: str) -> bool:
    """Overwrite every occurrence of `secret` in this process's command line (what `ps` and
    /proc/PID/cmdline show) with '*', in place; False where that cannot be done (not Linux)."""
    if len(secret) < 4:
        return False
    try:
        start, end = _argv_area()
        area = ctypes.string_at(start, end - start)
    except (OSError, ValueError, IndexError):
        return False
    needle = secret.encode()
    scrubbed = area.replace(needle, b"*" * len(needle))
    if scrubbed != area:
        ctypes.memmove(start, scrubbed, len(scrubbed))
    return True
