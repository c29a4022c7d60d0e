"""The job token: where it comes from, how strong it must be, and keeping it off command lines.

A token comes from `--token-file PATH` (the file must be the user's and mode 0600 or stricter), the
environment (`PHOENIXFT_TOKEN`), or `--token` (shown by `ps` until the process scrubs it from its
command line, at once: `scrub_argv`; prefer the other two). It must carry MIN_TOKEN_BITS bits by
`token_bits`. A generated one (`generate_token`, 256 bits) is written to a new 0600 file
(`write_token_file`), never printed. Re-exported by `phoenixft.controlplane.auth`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import secrets
import stat
from pathlib import Path

from phoenixft.errors import UserError

__all__ = ["TOKEN_ENV", "MIN_TOKEN_CHARS", "MIN_TOKEN_BITS", "MIN_DISTINCT", "resolve_token", "token_source",
           "read_token_file", "write_token_file", "generate_token", "token_bits", "check_token", "scrub_argv",
           "stretched", "SCRYPT_N", "SCRYPT_R"]

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


SCRYPT_N, SCRYPT_R = 1 << 14, 8  # 16 MiB and ~50 ms per derivation: what one offline guess costs
_SCRYPT_SALT = b"phoenixft-job-key-v1"
_WORD_RUN = 4  # a run of this many letters or more may be words: it counts _WORD_LETTER_BITS a letter
# words drawn from a generous dictionary (a million words and their capitalisations: 20 bits a word) carry
# about 4 bits a letter; 4.2 keeps every random `token_urlsafe(24)` (192 bits) above MIN_TOKEN_BITS
# (none refused in a million draws), where one choice per run refused about one in 2,400 of them
_WORD_LETTER_BITS = 4.2


@functools.lru_cache(maxsize=8)
def stretched(token: str) -> bytes:
    """The key every MAC of the job is made with: the token stretched with scrypt (memory-hard: SCRYPT_N x
    SCRYPT_R x 128 bytes), so that a party who reads a MAC from the store (the config's signature, a join
    response) pays one scrypt per token it guesses offline, not one HMAC. Computed once per process."""
    return hashlib.scrypt(token.encode("utf-8", errors="surrogatepass"), salt=_SCRYPT_SALT, n=SCRYPT_N,
                          r=SCRYPT_R, p=1, maxmem=SCRYPT_N * SCRYPT_R * 256, dklen=32)


def _alphabet(token: str) -> int:
    """The size of the alphabet the token's character classes span: lower 26, upper 26, digits 10, others 32."""
    size = sum(n for test, n in ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))
               if any(test(c) and c.isascii() for c in token))
    return size + (32 if any(not (c.isascii() and c.isalnum()) for c in token) else 0)


def _fresh(token: str) -> list[str]:
    """The token's characters that repeat nothing before them: a span of 3 or more characters that occurred
    earlier (case aside) is dropped, as a compressor would (`Password123!Password123?` keeps one copy)."""
    low, out, i = token.lower(), [], 0
    while i < len(token):
        n = 0
        while i + n < len(token) and low[i:i + n + 1] in low[:i]:
            n += 1
        if n >= 3:
            i += n
            continue
        out.append(token[i])
        i += 1
    return out


_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")  # a word as people write one: lower case, Capitalized, UPPER


def token_bits(token: str) -> float:
    """The token's entropy as estimated here: each character that repeats nothing before it (`_fresh`) counts
    log2 of the alphabet its character classes span, except that a run of _WORD_RUN or more letters (lower
    case, Capitalized or UPPER CASE), which may be dictionary words, counts _WORD_LETTER_BITS a letter when that
    is less: `correcthorsebatterystaple1` is 110 bits, not 129. In a random token such runs are short and rare,
    and cost it little."""
    alphabet = _alphabet(token)
    if alphabet <= 1:
        return 0.0
    per_char = math.log2(alphabet)
    fresh = "".join(_fresh(token))
    bits, at = 0.0, 0
    for m in _WORD.finditer(fresh):
        n = len(m.group())
        bits += (m.start() - at) * per_char + (min(_WORD_LETTER_BITS, per_char) * n if n >= _WORD_RUN else n * per_char)
        at = m.end()
    return bits + (len(fresh) - at) * per_char


def check_token(token: str, source: str) -> str:
    """Raise UserError unless `token` is usable; `source` names where it came from (a flag or the env).

    The rule: at least MIN_TOKEN_CHARS characters, no whitespace, at least MIN_TOKEN_BITS bits by
    `token_bits`, at least MIN_DISTINCT distinct characters, and not one string repeated."""
    how = "make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
    if len(token) < MIN_TOKEN_CHARS or token != token.strip() or any(c.isspace() for c in token):
        raise UserError(f"{source} is invalid: a job token needs at least {MIN_TOKEN_CHARS} characters and no "
                        f"whitespace (got {len(token)} characters); {how}")
    bits, distinct = token_bits(token), len(set(token))
    weak = (f"{distinct} distinct characters" if distinct < MIN_DISTINCT else "one string repeated"
            if token in (token + token)[1:-1] else f"{bits:.0f} bits" if bits < MIN_TOKEN_BITS else "")
    if weak:
        raise UserError(f"{source} is too weak ({weak}): a job token needs {MIN_TOKEN_BITS} bits of entropy, "
                        f"estimated from the alphabet its character classes span, with each repeated part counted "
                        f"once and each run of {_WORD_RUN} or more letters as dictionary words "
                        f"({_WORD_LETTER_BITS:g} bits a letter); at least {MIN_DISTINCT} distinct characters; {how}")
    return token


def scrub_argv(secret: str) -> bool:
    """Overwrite every occurrence of `secret` in this process's command line (what `ps` and
    /proc/PID/cmdline show) with '*', in place; False where that cannot be done (not Linux). The CLI does it
    for `--token` as the package is imported (`phoenixft.cli.argv_scrub`), before anything else."""
    from phoenixft.cli.argv_scrub import scrub

    return scrub(secret)
