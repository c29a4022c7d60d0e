"""The etcd control plane against the embedded TCPStore: step time, rendezvous, takeover, member loss.

    python bench/etcd.py            # model `small`, DP=2
    python bench/etcd.py --quick    # model `tiny`

One 3-member etcd cluster (loopback, started here, not counted) serves every etcd run. Parts:
1. failure-free step time, `--control-plane tcpstore` and `etcd://...` alternated in one
   invocation (tcp, etcd, tcp, etcd, ...: the machine is shared, so the ratio comes from one run),
   median after the warm-up;
2. process-group rendezvous: the time to build one gloo group of 4 processes on each backend
   (etcd is used for rendezvous directly, not through a side TCPStore: this is why that is fine);
3. takeover: `--coordinators 2`, the leading coordinator SIGKILLed at step 6 and a node at step 11
   (the standby-takeover scenario): how long until the standby leads, and the hot-swap after it;
4. member loss: `--control-plane etcd` (its own cluster), the raft leader SIGKILLed at step 5: the
   step it happened in against the median step, and whether a recovery was needed (it must not).

Prints tables, writes bench/results/etcd.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

from benchlib import REPO, RESULTS, log, machine_info, median, phoenix_run, ratio, steady, table, write_json

sys.path.insert(0, str(REPO / "src"))

_RDZV = textwrap.dedent("""
    import sys, time, json
    from datetime import timedelta
    import torch.distributed as dist
    sys.path.insert(0, {src!r})
    from phoenixft.controlplane import connect
    rank, addr, pre, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    s = connect(addr, 30.0)
    times = []
    for i in range(5):
        t = time.perf_counter()
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{{pre}}/{{i}}", s.c10d), rank, 4, timedelta(seconds=30))
        times.append(time.perf_counter() - t)
    if rank == 0:
        open(out, "w").write(json.dumps(times))
""")


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    import os

    t = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            t += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            pass
    return t / os.sysconf("SC_CLK_TCK")


def rendezvous(work: Path, addr: str, name: str) -> float | None:
    script = work / "rdzv.py"
    script.write_text(_RDZV.format(src=str(REPO / "src")))
    out = work / f"rdzv-{name}.json"
    pre = uuid.uuid4().hex[:8]
    import subprocess

    procs = [subprocess.Popen([sys.executable, str(script), str(r), addr, pre, str(out)], start_new_session=True)
             for r in range(4)]
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return median(json.loads(out.read_text())[1:]) if out.exists() else None  # the first one warms up


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="model tiny, fewer rounds")
    a = ap.parse_args()
    return 0 if run(a.quick) else 1


def run(quick: bool = False, out: Path = RESULTS) -> dict[str, Any]:
    from phoenixft.controlplane.etcd_cluster import EtcdCluster, etcd_binary
    from phoenixft.controlplane.server import serve_store

    if etcd_binary() is None:
        raise RuntimeError("no etcd binary: apt-get install etcd-server")
    model = "tiny" if quick else "small"
    rounds, steps = (2, 14) if quick else (3, 24)
    common = {"model": model, "nodes": 2, "steps": steps, "protect": "phoenix"}
    res: dict[str, Any] = {"machine": machine_info(), "model": model, "rounds": rounds, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-etcd-") as tmp, EtcdCluster(3, tag="bench") as c:
        work = Path(tmp)
        dts: dict[str, list[float]] = {"tcpstore": [], "etcd": []}
        etcd_cpu, etcd_wall = 0.0, 0.0
        for i in range(rounds):
            for name in dts:
                log(f"etcd: failure-free {name} round {i + 1}/{rounds} ({model}, DP=2)")
                cp = c.url if name == "etcd" else "tcpstore"
                c0, t0 = _cpu_s([p.pid for p in c.procs if p is not None]), time.monotonic()
                rep = phoenix_run(work / f"ff-{name}-{i}", probe=False, spares=0, control_plane=cp, **common)
                if name == "etcd":
                    etcd_cpu += _cpu_s([p.pid for p in c.procs if p is not None]) - c0
                    etcd_wall += time.monotonic() - t0
                if rep.get("state") != "done":
                    raise RuntimeError(f"{name}: {rep.get('error')}")
                dts[name] += [m["dt"] for m in steady(rep["metrics"])]
        res["step_time_s"] = {k: median(v) for k, v in dts.items()}
        res["step_time_ratio_etcd_vs_tcpstore"] = ratio(res["step_time_s"]["etcd"], res["step_time_s"]["tcpstore"])
        # the 3 etcd servers share these cores with training here; in production they run elsewhere
        res["etcd_server_cpu_cores"] = etcd_cpu / etcd_wall if etcd_wall else None
        log("etcd: process-group rendezvous, 4 processes")
        srv = serve_store("127.0.0.1", 0)
        res["rendezvous_s"] = {"tcpstore": rendezvous(work, srv.addr, "tcp"),
                               "etcd": rendezvous(work, f"{c.url}/bench-rdzv", "etcd")}
        log("etcd: standby takeover (kill:coordinator@step=6, kill:node=1@step=11)")
        rep = phoenix_run(work / "takeover", probe=False, spares=1, control_plane=c.url, coordinators=2,
                          inject=["kill:coordinator@step=6", "kill:node=1@step=11,wait=60"],
                          **{**common, "steps": 16, "model": "tiny"})
        cp_rec = (rep.get("control_plane") or [{}])[0]
        rec = (rep.get("recoveries") or [{}])[0]
        res["takeover"] = {"state": rep.get("state"), "downtime_s": cp_rec.get("downtime_s"),
                           "new_leader": cp_rec.get("new_leader"), "hotswap_recovery_s": rec.get("recovery_s"),
                           "lost_steps": rec.get("lost_steps")}
        log("etcd: raft leader SIGKILLed at step 5 (--control-plane etcd)")
        rep = phoenix_run(work / "member", probe=False, spares=0, control_plane="etcd",
                          inject=["kill:etcd=leader@step=5"], **{**common, "steps": 14})
        ms = {m["step"]: m["dt"] for m in rep["metrics"]}
        res["member_loss"] = {"state": rep.get("state"), "recoveries": len(rep.get("recoveries") or []),
                              "step_with_kill_s": ms.get(5), "median_step_s": median(list(ms.values())),
                              "extra_s": (ms.get(5) or 0) - (median(list(ms.values())) or 0)}
    st = res["step_time_s"]
    table(f"failure-free step time, {model}, DP=2, {rounds} alternated rounds",
          ["control plane", "step s", "vs tcpstore"],
          [["tcpstore", st["tcpstore"], 1.0],
           ["etcd (3 members)", st["etcd"], res["step_time_ratio_etcd_vs_tcpstore"]]])
    log(f"etcd: the 3 etcd servers used {res['etcd_server_cpu_cores']:.3f} CPU cores during the etcd runs "
        "(on these same 2 cores)")
    rz = res["rendezvous_s"]
    table("gloo group of 4 processes: rendezvous time", ["store", "s"], [["tcpstore", rz["tcpstore"]],
                                                                         ["etcd", rz["etcd"]]])
    tk, ml = res["takeover"], res["member_loss"]
    table("losses", ["fault", "result"],
          [["leader coordinator SIGKILLed", f"standby leads after {tk['downtime_s']} s; state {tk['state']}"],
           ["then a node SIGKILLed", f"hot-swap {tk['hotswap_recovery_s']} s, lost {tk['lost_steps']} step(s)"],
           ["etcd raft leader SIGKILLed", f"step {ml['step_with_kill_s']} s vs median {ml['median_step_s']} s; "
                                         f"recoveries {ml['recoveries']}; state {ml['state']}"]])
    res["elapsed_note"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(out / "etcd.json", res)
    return res


if __name__ == "__main__":
    sys.exit(main())
