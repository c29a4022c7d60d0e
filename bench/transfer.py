"""State transfer during a hot-swap: bytes moved / transfer seconds.

    python bench/transfer.py            # one hot-swap on `medium` (~100M parameters, ~800 MB moved)
    python bench/transfer.py --quick    # the same on `small` (~11M parameters)
    python bench/transfer.py --model small --runs 3

Each run: `phoenixft run --nodes 2 --spares 1 --model M --steps 5 --micro-batch 1 --protect phoenix
--inject kill:node=1@step=4,phase=backward,wait=180` (node 1 SIGKILLed after the forward pass of
step 4, once the spare is warm; the spare is promoted and receives the parameters from the
survivor and the dead node's optimizer shard from its replica). From the report:

* bytes_moved: parameters (with the model's buffers) + optimizer shard received by the new member;
* transfer_s: restore_params_s + restore_optimizer_s, each the slowest member's, measured after every
  member reached the transfer (the wait for that is `transfer_sync_s`, reported per rank, not
  counted); restore_optimizer_s includes verifying the received shard and committing it;
* gbps = bytes_moved / transfer_s / 1e9 (the median over the runs);
* link_gbps: right after each hot-swap, `bench/gloo_link.py` moves the same number of bytes between two
  bare processes over the same kind of group (`XFER_LANES` connections, 16 MiB rounds): the floor on
  this machine at that moment. `vs_link` = gbps / link_gbps, per run (the median is the headline
  `recovery_transfer_vs_link`): how much of the link the hot-swap uses, with the machine's noise
  mostly divided out.

Writes bench/results/transfer.json.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import RESULTS, log, machine_info, median, table, write_json
from recovery import phoenix_recovery


def one(work: Path, model: str) -> dict[str, Any]:
    e = phoenix_recovery(work, model=model, nodes=2, kill_step=4, extra_steps=1, micro_batch=1, wait_s=180)
    st = e["stages"]
    transfer_s = (st.get("restore_params_s") or 0.0) + (st.get("restore_optimizer_s") or 0.0)
    e["transfer_s"] = transfer_s
    e["gbps"] = e["bytes_moved"] / transfer_s / 1e9 if transfer_s > 0 else None
    return e


def link_gbps(n_bytes: int) -> float | None:
    """GB/s of `bench/gloo_link.py` moving `n_bytes` once with the recovery group's lanes (None if it failed)."""
    from phoenixft.distributed.comm import XFER_LANES

    cmd = [sys.executable, str(Path(__file__).with_name("gloo_link.py")), "--mb", f"{n_bytes / 1e6:.3f}",
           "--lanes", str(XFER_LANES), "--trials", "1"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    except subprocess.TimeoutExpired:
        return None
    m = re.search(r"= ([0-9.]+) GB/s", out)
    return float(m.group(1)) if m else None


def run(quick: bool = False, *, model: str | None = None, runs: int = 1, out: Path = RESULTS) -> dict[str, Any]:
    t0 = time.time()
    model = model or ("small" if quick else "medium")
    work = Path(tempfile.mkdtemp(prefix="bench-transfer-"))
    entries = []
    try:
        for i in range(runs):
            log(f"transfer: hot-swap {i + 1}/{runs} on {model}")
            e = one(work / f"r{i}", model)
            e["link_gbps"] = link_gbps(e["bytes_moved"])
            e["vs_link"] = e["gbps"] / e["link_gbps"] if e["gbps"] and e["link_gbps"] else None
            entries.append(e)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = [e["gbps"] for e in entries if e["gbps"]]
    vs = [e["vs_link"] for e in entries if e["vs_link"]]
    lk = [e["link_gbps"] for e in entries if e["link_gbps"]]
    res = {
        "part": "transfer",
        "quick": quick,
        "model": model,
        "machine": machine_info(),
        "recovery_transfer_gbps": median(gb) if gb else None,
        f"recovery_transfer_gbps_{model}": median(gb) if gb else None,
        "recovery_transfer_link_gbps": median(lk) if lk else None,
        "recovery_transfer_vs_link": median(vs) if vs else None,
        "runs": entries,
        "elapsed_s": round(time.time() - t0, 1),
    }
    table(
        f"State transfer in a hot-swap ({model}, DP=2)",
        ["run", "bytes moved", "params s", "optimizer s", "GB/s", "bare link GB/s", "share of link", "lost steps"],
        [
            [i, f"{e['bytes_moved']:,}", f"{e['stages']['restore_params_s']:.3f}",
             f"{e['stages']['restore_optimizer_s']:.3f}", f"{e['gbps']:.2f}" if e["gbps"] else "-",
             f"{e['link_gbps']:.2f}" if e["link_gbps"] else "-", f"{e['vs_link']:.2f}" if e["vs_link"] else "-",
             e["lost_steps"]]
            for i, e in enumerate(entries)
        ],
    )
    write_json(Path(out) / "transfer.json", res)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="`small` instead of `medium`")
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    run(a.quick, model=a.model, runs=a.runs, out=Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
