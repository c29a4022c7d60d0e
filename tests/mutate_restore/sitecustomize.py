"""A test-only mutation of the restore, loaded into every process of a test run through PYTHONPATH (only
tests/test_evidence.py puts this folder there): with PHOENIXFT_TEST_MUTATE_RESTORE set (read at the
restore: a warm zygote imported this module before the variable was), rank 0's in-place restore of epoch 1
ends by installing, under headers that say the resume step and rank 0's shard, the previous step's
optimizer state ("previous") or the replica of another shard it holds ("other_shard")."""

from __future__ import annotations

import os
from typing import Any

from phoenixft.protect.snapshot import checksum
from phoenixft.recovery import restore

_real = restore.restore_in_place


def _mutated(m: Any, topo: Any, r: int, timings: dict[str, Any], bad: list[str]) -> None:
    _real(m, topo, r, timings, bad)
    mode = os.environ.get("PHOENIXFT_TEST_MUTATE_RESTORE", "")
    st = m.trainer.state
    half = st.half_with(r)
    if not mode or topo.epoch != 1 or m.rank != 0 or half is None:
        return
    if mode == "previous":
        src = st.payload(1 - half).clone()  # the older committed half (step r-1)
    else:
        kept = [m.scheme.copy_of(s, r) for s in range(topo.world) if s != m.rank]
        src = next(k for k in kept if k is not None).reshape(st.payload(half).shape).clone()
    st.payload(half).copy_(src)
    st.header[half, 1] = checksum(st.payload(half))  # the header agrees with what was installed


restore.restore_in_place = _mutated
