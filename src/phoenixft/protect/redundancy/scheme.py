"""The redundancy scheme of a run: `replicas:K` (full copies) or `ec:D+H` (erasure-coded groups).

`parse_redundancy("ec:4+2")` gives a `Redundancy`; `Redundancy.for_ring(n)` the scheme that a
data-parallel ring of n ranks (one per node) can actually place: replicas live on other nodes
(K <= n - 1), a group of D members and its H parity blocks need D + H distinct nodes. A ring that
shrank below that keeps the protection it can: H' = min(H, n - 1) parity blocks over groups of
D' = min(D, n - H') members (a 1-member group with H' parity blocks is H' replicas).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["Redundancy", "parse_redundancy", "replicas_of", "VALID", "MAX_GROUP"]

VALID = "replicas:K (K >= 1 full copies) or ec:D+H (D >= 1 data shards per group, H >= 1 parity blocks)"
MAX_GROUP = 256  # D + H: the codes work in GF(2^8)


@dataclass(frozen=True)
class Redundancy:
    kind: str  # "replicas" or "ec"
    k: int = 0  # replicas: copies on other nodes
    d: int = 0  # ec: data shards per group
    h: int = 0  # ec: parity blocks per group

    @property
    def is_ec(self) -> bool:
        return self.kind == "ec"

    @property
    def tolerates(self) -> int:
        """Nodes of one group (replicas: an owner and its holders) that may fail together."""
        return self.h if self.is_ec else self.k

    @property
    def min_nodes(self) -> int:
        return self.d + self.h if self.is_ec else self.k + 1

    def __str__(self) -> str:
        return f"ec:{self.d}+{self.h}" if self.is_ec else f"replicas:{self.k}"

    def for_ring(self, n: int) -> Redundancy | None:
        """The scheme a ring of n ranks on n distinct nodes can hold; None when n == 1 (no other node)."""
        if n <= 1:
            return None
        if not self.is_ec:
            return Redundancy("replicas", k=min(self.k, n - 1))
        h = min(self.h, n - 1)
        return Redundancy("ec", d=max(1, min(self.d, n - h)), h=h)


_RE = re.compile(r"^(?:(replicas):(\d+)|(ec):(\d+)\+(\d+))$")


def replicas_of(text: str) -> int | None:
    """K of a `replicas:K` text, whatever K (also one parse_redundancy refuses); None for any other text."""
    m = _RE.match(text.strip())
    return int(m.group(2)) if m and m.group(1) else None


@functools.lru_cache(maxsize=64)
def parse_redundancy(text: str) -> Redundancy:
    """Parse `replicas:K` or `ec:D+H`; ValueError saying what is valid otherwise. (The one parser of
    --redundancy; the result is immutable, so repeated texts are parsed once.)"""
    m = _RE.match(text.strip())
    if not m:
        raise ValueError("not replicas:K nor ec:D+H")
    if m.group(1):
        k = int(m.group(2))
        if k < 1:
            raise ValueError("K must be >= 1")
        return Redundancy("replicas", k=k)
    d, h = int(m.group(4)), int(m.group(5))
    if d < 1:
        raise ValueError("D must be >= 1 (data shards per group)")
    if h < 1:
        raise ValueError("H must be >= 1 (parity blocks per group; H = 0 would protect nothing)")
    if d + h > MAX_GROUP:
        raise ValueError(f"D + H must be <= {MAX_GROUP} (the code works in GF(2^8))")
    return Redundancy("ec", d=d, h=h)
