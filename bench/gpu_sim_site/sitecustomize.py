"""The GPU machine's constraints, simulated on a CPU host for `bench/gpu_check.sh --dry-run` and `--rehearse` (see
bench/gpu_deps.py): Python imports this module at start-up when its folder is on PYTHONPATH.

- `PHOENIXFT_SIM_MISSING` (comma-separated top-level modules): importing one raises
  ModuleNotFoundError, as on a machine where it is not installed;
- `PHOENIXFT_SIM_OFFLINE=1`: a socket may only connect to a loopback address (no network).
"""

from __future__ import annotations

import importlib.abc
import ipaddress
import os
import socket
import sys

_MISSING = frozenset(m for m in os.environ.get("PHOENIXFT_SIM_MISSING", "").split(",") if m)


class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name.partition(".")[0] in _MISSING:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed on the simulated GPU machine)",
                                      name=name)
        return None


if _MISSING:
    sys.meta_path.insert(0, _Missing())

if os.environ.get("PHOENIXFT_SIM_OFFLINE") == "1":
    _connect = socket.socket.connect
    _connect_ex = socket.socket.connect_ex

    def _loopback(address: object) -> bool:
        if not isinstance(address, tuple) or not address:
            return True  # a Unix socket
        host = str(address[0])
        if host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            return False

    def connect(self: socket.socket, address: object) -> None:
        if not _loopback(address):
            raise OSError(101, f"Network is unreachable (simulated GPU machine without network): {address!r}")
        _connect(self, address)  # type: ignore[arg-type]

    def connect_ex(self: socket.socket, address: object) -> int:
        if not _loopback(address):
            return 101
        return _connect_ex(self, address)  # type: ignore[arg-type]

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
