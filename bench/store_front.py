"""What the store's front costs and what it bounds: a bare TCPStore against the same store behind its front,
measured in one invocation.

    python bench/store_front.py            # 5,000 round trips, 64 values of 8 MiB, 1,000 malformed frames
    python bench/store_front.py --quick    # fewer of each

1. one `get` round trip (median, us) and the front's CPU per request (us, from /proc);
2. a stranger's 8 MiB values written as fast as it can: how much the store took (MiB) with no limit, and
   behind the front with `--store-max-mb 256` (its connection closed at the limit);
3. malformed frames: the bytes torch's server writes to its stderr (a stack trace a frame) against the
   front's lines (one per peer, then counted).

Prints a table, writes bench/results/store_front.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import REPO, RESULTS, log, machine_info, median, table, write_json

sys.path.insert(0, str(REPO / "src"))


def _cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def round_trips(n: int) -> dict[str, float | None]:
    import torch.distributed as dist

    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.storewire import Limits

    out: dict[str, float | None] = {}
    bare = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    front = serve_job_store("127.0.0.1", 0, None, Limits())
    try:
        for name, port in (("bare", bare.port), ("front", int(front.local_addr.rsplit(":", 1)[1]))):
            c = _client(port)
            c.set("k", b"x" * 64)
            cpu0 = _cpu(front.relay.proc.pid)
            times = []
            for _ in range(n):
                t = time.perf_counter()
                c.get("k")
                times.append(time.perf_counter() - t)
            out[f"{name}_get_us"] = (median(times[100:]) or 0.0) * 1e6
            if name == "front":
                out["front_cpu_us_per_request"] = (_cpu(front.relay.proc.pid) - cpu0) / n * 1e6
    finally:
        front.stop()
    return out


def flood(count: int) -> dict[str, float]:
    """MiB of 8 MiB values a stranger got into the store: bare, and behind a front holding at most 256 MiB."""
    import torch.distributed as dist

    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.storewire import Limits

    value = b"x" * (8 << 20)
    out = {}
    bare = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    front = serve_job_store("127.0.0.1", 0, None, Limits(max_bytes=256 << 20))
    try:
        for name, port in (("bare", bare.port), ("front", int(front.local_addr.rsplit(":", 1)[1]))):
            c = _client(port)
            took = 0
            for i in range(count):
                try:
                    c.set(f"junk/{i}", value)
                    c.check([f"junk/{i}"])  # (an answered request: the set reached the store, or was refused)
                    took += 1
                except Exception:  # noqa: BLE001 - the front closed the connection at its limit
                    break
            mine = _client(port) if name == "front" else c
            stored = sum(1 for i in range(count) if mine.check([f"junk/{i}"]))
            out[f"{name}_mib_stored"] = float(stored * 8)
            out[f"{name}_values_sent"] = float(took)
    finally:
        front.stop()
    return out


def malformed(count: int) -> dict[str, float]:
    """Bytes written to stderr for `count` malformed frames: by torch's server (bare), by the front."""
    out = {}
    code = f"""
import datetime, sys, time
sys.path.insert(0, {str(REPO / 'src')!r})
mode = sys.argv[1]
if mode == "bare":
    import torch.distributed as dist
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = s.port
else:
    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.storewire import Limits
    f = serve_job_store("127.0.0.1", 0, None, Limits())
    port = int(f.local_addr.rsplit(":", 1)[1])
print(port, flush=True)
time.sleep(60)
"""
    for mode in ("bare", "front"):
        with tempfile.TemporaryFile() as err:
            p = subprocess.Popen([sys.executable, "-c", code, mode], stdout=subprocess.PIPE, stderr=err, text=True)
            assert p.stdout is not None
            port = int(p.stdout.readline())
            hello = b"\x00\xce\xf7\x85<"
            for _ in range(count):
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(hello + b"\x01" + (1 << 40).to_bytes(8, "little") + b"x")  # a key of 1 TB
                    s.settimeout(1.0)
                    try:
                        s.recv(1)
                    except OSError:
                        pass
            time.sleep(0.5)
            p.kill()
            p.wait()
            err.seek(0)
            data = err.read()
            out[f"{mode}_stderr_bytes"] = float(len(data))
            out[f"{mode}_stderr_lines"] = float(data.count(b"\n"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    run(a.quick)
    return 0


def run(quick: bool = False, out: Path = RESULTS) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine_info()}
    log("store front: round trips")
    res["round_trip"] = round_trips(1000 if quick else 5000)
    log("store front: a stranger's 8 MiB values")
    res["flood"] = flood(40 if quick else 64)
    log("store front: malformed frames")
    res["malformed"] = malformed(100 if quick else 1000)
    rt, fl, mf = res["round_trip"], res["flood"], res["malformed"]
    table("the store bare and behind its front", ["figure", "bare", "front"],
          [["get round trip, us", rt["bare_get_us"], rt["front_get_us"]],
           ["front CPU per request, us", None, rt["front_cpu_us_per_request"]],
           ["8 MiB values stored, MiB (front: --store-max-mb 256)", fl["bare_mib_stored"], fl["front_mib_stored"]],
           ["stderr bytes for the malformed frames", mf["bare_stderr_bytes"], mf["front_stderr_bytes"]],
           ["stderr lines for the malformed frames", mf["bare_stderr_lines"], mf["front_stderr_lines"]]])
    write_json(out / "store_front.json", res)
    return res


if __name__ == "__main__":
    sys.exit(main())
