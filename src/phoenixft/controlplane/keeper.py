"""Values a process wrote for others to find, put back when something else overwrites or deletes them.

Whoever reaches the store can overwrite any key: a reader then sees the job's value as absent (a forged
one does not verify). Most of what the job writes is rewritten anyway (heartbeats, progress, the run's end
until it is seen); what is written once and read later (the config, an epoch's topology and its signature,
a worker's readiness and descriptor, an admission's challenge and verdict) would be lost for good, and a
reader that waits for it would wait in vain. So each process hands such values to its `Keeper`, which
writes them and, at most every `every_s`, looks whether the store still holds each one byte for byte and
writes back the ones that changed (logged once per key). The look costs one existence check and one
multi-get while every kept key is there. A value the job itself replaces or retires is handed again
(`put`) or dropped (`drop`, `drop_prefix`): the keeper never fights the job's own writes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from phoenixft.controlplane import sealed
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import note_bad

__all__ = ["Keeper", "KEEP_EVERY_S"]

KEEP_EVERY_S = 1.0


class Keeper:
    """Keys this process wrote and keeps (`put` seals a value, `put_raw` keeps bytes as given); `tick()` puts
    back what changed. Thread-safe; `tick` makes store calls on the caller's client."""

    def __init__(self, store: Store, every_s: float = KEEP_EVERY_S, guard: Callable[[], bool] | None = None) -> None:
        self.store = store
        self.every_s = every_s
        self.guard = guard  # values are put back only while this says so (a coordinator: while it leads)
        self._stop = threading.Event()
        self._kept: dict[str, bytes] = {}
        self._at = 0.0
        self._lock = threading.Lock()
        self.put_back = 0  # values written back so far

    def start(self, store: Store | None = None) -> Keeper:
        """Tick from a daemon thread of its own every `every_s` from now on, on `store` (a client whose calls
        are short and never block: by default the keeper's), until `stop()`. A process whose loops do not
        call `tick` starts one."""
        if store is not None:
            self.store = store

        def loop() -> None:
            wait = self.every_s
            while not self._stop.wait(wait):
                try:
                    self.tick(force=True)
                    wait = self.every_s
                except Exception:  # noqa: BLE001 - the store did not answer: asked again, less often while it does not
                    wait = min(wait * 2, 60.0)

        threading.Thread(target=loop, name="phoenixft-keeper", daemon=True).start()
        return self

    def stop(self) -> None:
        """Keep nothing more (this process's role ended: fenced, or its run over)."""
        self._stop.set()
        with self._lock:
            self._kept.clear()

    def put(self, name: str, value: str | bytes) -> None:
        """Write `value` sealed at `name` now, and keep it there."""
        self.put_raw(name, sealed.seal(name, value))

    def put_raw(self, name: str, raw: bytes) -> None:
        """Write `raw` at `name` now, and keep it there."""
        self.put_many_raw([name], [raw])

    def put_many_raw(self, names: Sequence[str], raws: Sequence[bytes]) -> None:
        """Write every `raws[i]` at `names[i]` in one request (in order), and keep them."""
        with self._lock:
            for n, r in zip(names, raws, strict=True):
                self._kept[n] = bytes(r)
        self.store.multi_set(list(names), list(raws))

    def keep(self, name: str, raw: bytes) -> None:
        """Keep `raw` at `name` from now on (written already)."""
        with self._lock:
            self._kept[name] = bytes(raw)

    def drop(self, *names: str) -> None:
        """Stop keeping these keys (the job replaced or retired them)."""
        with self._lock:
            for n in names:
                self._kept.pop(n, None)

    def drop_prefix(self, prefix: str) -> None:
        with self._lock:
            for n in [n for n in self._kept if n.startswith(prefix)]:
                del self._kept[n]

    def kept(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._kept)

    def tick(self, force: bool = False) -> list[str]:
        """Put back every kept value the store no longer holds byte for byte (at most every `every_s` unless
        `force`); the names put back."""
        now = time.monotonic()
        if not force and now - self._at < self.every_s:
            return []
        self._at = now
        kept = self.kept()
        if not kept or self._stop.is_set() or (self.guard is not None and not self.guard()):
            return []
        names = list(kept)
        if self.store.check(names):  # (a multi-get blocks on a missing key on a TCPStore)
            have: list[bytes | None] = [bytes(v) for v in self.store.multi_get(names)]
        else:
            have = [self.store.get_nowait(n) for n in names]
        back = [n for n, v in zip(names, have, strict=True) if v != kept[n]]
        for n, v in zip(names, have, strict=True):
            if n in back:
                note_bad(n, "overwritten or deleted by something other than this job; put back", v or b"")
        if back:
            with self._lock:  # (a value handed again meanwhile is the newer one)
                now_kept = {n: self._kept[n] for n in back if n in self._kept}
            self.store.multi_set(list(now_kept), list(now_kept.values()))
            self.put_back += len(now_kept)
        return back
