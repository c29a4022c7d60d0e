"""What TLS on the control plane costs: store round trips, step time, recovery time, with and without.

    python bench/tls.py            # model `small`, DP=2
    python bench/tls.py --quick    # model `tiny`, fewer rounds (--rounds N: N plain/TLS pairs)

With `--tls-*` every agent reaches the store through its host's forwarder and the head's gateway
(controlplane/tls.py): two relays and a TLS session per connection more than the plain store. Parts,
plain and TLS alternated in one invocation (plain, tls, plain, tls, ...: the machine is shared, so
the ratios come from one run):
1. one store round trip (`set` then `get` of a 64-byte value, 2000 times): a client of the store on
   loopback, and the same through a forwarder and a gateway (both on this host);
2. failure-free step time, median after the warm-up (`phoenixft run`, its agents through TLS);
3. recovery: a node SIGKILLed at step 6, hot-swapped onto the spare: the report's `recovery_s`.

Prints tables, writes bench/results/tls.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import REPO, RESULTS, log, machine_info, median, phoenix_run, ratio, steady, table, write_json

sys.path.insert(0, str(REPO / "src"))

OPS = 2000


def round_trips(tls: Any) -> dict[str, float | None]:
    """Median seconds of one set+get pair: straight to the store, and through a forwarder and a gateway."""
    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.store import tcp_client
    from phoenixft.controlplane.storewire import Limits
    from phoenixft.controlplane.tls import start_forwarder

    front = serve_job_store("127.0.0.1", 0, tls.env(), Limits())  # (the store behind its front, TLS at the gateway)
    fwd = start_forwarder(front.public_addr, tls)
    out: dict[str, float | None] = {}
    try:
        for name, port in (("plain", int(front.local_addr.rsplit(":", 1)[1])), ("tls", fwd.port)):
            c = tcp_client("127.0.0.1", port, 30.0)
            times = []
            for i in range(OPS):
                t = time.perf_counter()
                c.set(f"k{i % 16}", b"x" * 64)
                c.get(f"k{i % 16}")
                times.append(time.perf_counter() - t)
            out[name] = median(times[100:])
    finally:
        fwd.stop()
        front.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="model tiny, fewer rounds")
    ap.add_argument("--rounds", type=int, default=0, help="plain/TLS round pairs (default: 3, --quick 2)")
    a = ap.parse_args()
    return 0 if run(a.quick, rounds=a.rounds) else 1


def run(quick: bool = False, out: Path = RESULTS, rounds: int = 0) -> dict[str, Any]:
    from phoenixft.cli.cmd_certs import make_certs
    from phoenixft.controlplane.tls import TlsFiles

    model = "tiny" if quick else "small"
    rounds, steps = rounds or (2 if quick else 3), (14 if quick else 24)
    common = {"model": model, "nodes": 2, "protect": "phoenix"}
    res: dict[str, Any] = {"machine": machine_info(), "model": model, "rounds": rounds, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-tls-") as tmp:
        work = Path(tmp)
        make_certs(work / "pki", ["job"], [])
        files = TlsFiles(str(work / "pki/job.crt"), str(work / "pki/job.key"), str(work / "pki/ca.crt"))
        flags = {"plain": {}, "tls": {"tls_cert": files.cert, "tls_key": files.key, "tls_ca": files.ca}}
        log(f"tls: store round trips ({OPS} set+get pairs each way)")
        res["round_trip_s"] = round_trips(files)
        res["round_trip_ratio"] = ratio(res["round_trip_s"]["tls"], res["round_trip_s"]["plain"])
        dts: dict[str, list[float]] = {"plain": [], "tls": []}
        recs: dict[str, list[float]] = {"plain": [], "tls": []}
        for i in range(rounds):
            for name in dts:
                log(f"tls: failure-free {name} round {i + 1}/{rounds} ({model}, DP=2)")
                rep = phoenix_run(work / f"ff-{name}-{i}", probe=False, spares=0, steps=steps, **common,
                                  **flags[name])
                if rep.get("state") != "done":
                    raise RuntimeError(f"{name}: {rep.get('error')}")
                dts[name] += [m["dt"] for m in steady(rep["metrics"])]
                log(f"tls: kill:node=1@step=6 {name} round {i + 1}/{rounds}")
                rep = phoenix_run(work / f"kill-{name}-{i}", probe=False, spares=1, steps=10,
                                  inject=["kill:node=1@step=6,wait=60"], **common, **flags[name])
                rec = (rep.get("recoveries") or [{}])[0]
                if rep.get("state") != "done" or rec.get("action") != "hotswap":
                    raise RuntimeError(f"{name} kill: {rep.get('state')} {rep.get('error')} {rec}")
                recs[name].append(float(rec["recovery_s"]))
        res["step_time_s"] = {k: median(v) for k, v in dts.items()}
        res["step_time_ratio_tls_vs_plain"] = ratio(res["step_time_s"]["tls"], res["step_time_s"]["plain"])
        res["recovery_s"] = {k: median(v) for k, v in recs.items()}
        res["recovery_s_all"] = recs
        res["recovery_ratio_tls_vs_plain"] = ratio(res["recovery_s"]["tls"], res["recovery_s"]["plain"])
    rt, st, rc = res["round_trip_s"], res["step_time_s"], res["recovery_s"]
    table("control plane with and without TLS", ["figure", "plain", "TLS", "ratio"],
          [["store set+get round trip, s", rt["plain"], rt["tls"], res["round_trip_ratio"]],
           [f"failure-free step, s ({model}, DP=2)", st["plain"], st["tls"], res["step_time_ratio_tls_vs_plain"]],
           ["hot-swap recovery, s (kill at step 6)", rc["plain"], rc["tls"], res["recovery_ratio_tls_vs_plain"]]])
    res["elapsed_note"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(out / "tls.json", res)
    return res


if __name__ == "__main__":
    sys.exit(main())
