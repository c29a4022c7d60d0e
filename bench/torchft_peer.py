"""Peer comparison: torchft (PyPI 0.2.0) replica groups, one killed and restarted.

    python bench/torchft_peer.py            # full: headline model (`small`), default and tuned timeouts,
                                            #       plus a failure-free reference for the trajectory
    python bench/torchft_peer.py --quick    # `tiny`, tuned timeouts only

Setup: a `torchft_lighthouse --min_replicas 1` on 127.0.0.1 and N=2 replica groups of one
process each (bench/torchft_train.py: phoenixft's GPT, gradients averaged with
`manager.allreduce`). Replica group 1 SIGKILLs itself after the forward pass of step S; this
harness restarts it at once, as its launcher (torchrun --max-restarts, a Slurm requeue, or
torchft's torchx launcher) would. Measured from the per-step logs:
- survivor stall: the gap between the survivor's last commit before the fault and its first
  commit after it, minus its median step time; steps that were not committed;
- trajectory: steps the survivor committed with fewer participants (its global batch shrank:
  the trajectory leaves the failure-free one), and, in full mode, the survivor's loss against
  a failure-free run of the same configuration;
- heal (`torchft_heal_s`): from the fault until the relaunched replica has joined the quorum
  and loaded the healed state from a survivor, ready to train its first step at full strength
  (the same moment phoenixft's time-to-resume ends at); `first_commit_s` adds that first step.
Timeouts: torchft's defaults (lighthouse heartbeat 5 s, join 60 s, quorum tick 100 ms; manager,
quorum and gloo timeouts 60 s) and a tuned setting (heartbeat 500 ms, join 200 ms, tick 20 ms;
manager 10 s, gloo 5 s). If torchft is not installed, the result says so and nothing runs.

Prints a table, writes bench/results/torchft.json and bench/results/torchft.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import (
    BENCH_DIR,
    RESULTS,
    VENV_BIN,
    free_port,
    kill_group,
    log,
    machine_info,
    median,
    plt,
    spawn,
    table,
    tail,
    write_json,
)

DEFAULTS = {
    "heartbeat_timeout_ms": 5000,
    "join_timeout_ms": 60000,
    "quorum_tick_ms": 100,
    "manager_timeout_s": 60.0,
    "quorum_timeout_s": 60.0,
    "gloo_timeout_s": 60.0,
}
TUNED = {
    "heartbeat_timeout_ms": 500,
    "join_timeout_ms": 200,
    "quorum_tick_ms": 20,
    "manager_timeout_s": 10.0,
    "quorum_timeout_s": 30.0,
    "gloo_timeout_s": 5.0,
}


def availability() -> tuple[bool, str]:
    try:
        import torchft  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, (
            f"torchft is not installed in this environment ({type(e).__name__}: {e}); "
            "install the optional extra: pip install -e '.[bench]' (torchft==0.2.0)"
        )
    lh = VENV_BIN / "torchft_lighthouse"
    if not lh.exists() and not shutil.which("torchft_lighthouse"):
        return False, "torchft is installed but its torchft_lighthouse binary was not found"
    from importlib.metadata import version

    return True, (
        f"torchft {version('torchft')} from PyPI; gradients averaged with manager.allreduce because "
        "torchft.DistributedDataParallel crashes the survivors on gloo (assert fut._fut in ddp.py _comm_hook)"
    )


def _wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"torchft_lighthouse did not listen on 127.0.0.1:{port}")


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def scenario(
    work: Path,
    *,
    model: str,
    steps: int,
    kill_step: int | None,
    setting: dict[str, Any],
    replicas: int = 2,
    steps_after_heal: int = 3,
    grad_sync: str = "manager",
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run one torchft job; with kill_step, replica 1 dies at that step and is relaunched.

    Without kill_step every replica runs `steps` steps; with it the job runs until the relaunched
    replica has committed `steps_after_heal` steps (at most 10 x `steps`).
    """
    work.mkdir(parents=True, exist_ok=True)
    lh_bin = (
        str(VENV_BIN / "torchft_lighthouse")
        if (VENV_BIN / "torchft_lighthouse").exists()
        else str(shutil.which("torchft_lighthouse"))
    )
    port = free_port()
    lh_cmd = [
        lh_bin,
        "--min_replicas",
        "1",
        "--bind",
        f"127.0.0.1:{port}",
        "--heartbeat_timeout_ms",
        str(setting["heartbeat_timeout_ms"]),
        "--join_timeout_ms",
        str(setting["join_timeout_ms"]),
        "--quorum_tick_ms",
        str(setting["quorum_tick_ms"]),
    ]
    marker = work / "killed.json"
    stop = work / "stop"
    barrier = work / "barrier"
    barrier.mkdir(exist_ok=True)

    def replica_cmd(i: int, first: bool = True) -> list[str]:
        cmd = [
            sys.executable,
            str(BENCH_DIR / "torchft_train.py"),
            "--replica-id",
            str(i),
            "--lighthouse",
            f"http://127.0.0.1:{port}",
            "--model",
            model,
            "--steps",
            str(steps if not kill_step else 10 * steps),
            "--timeout-s",
            str(setting["manager_timeout_s"]),
            "--quorum-timeout-s",
            str(setting["quorum_timeout_s"]),
            "--gloo-timeout-s",
            str(setting["gloo_timeout_s"]),
            "--step-log",
            str(work / f"r{i}.jsonl"),
            "--stop-file",
            str(stop),
            "--replicas",
            str(replicas),
            "--grad-sync",
            grad_sync,
        ]
        if first:
            cmd += ["--barrier-dir", str(barrier)]
        if kill_step and i == 1:
            cmd += ["--kill-at-step", str(kill_step), "--marker", str(marker)]
        return cmd

    env = {"OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    procs: list[Any] = []
    lh = spawn(lh_cmd, work / "lighthouse.log", env)
    procs.append(lh)
    restarted_at: float | None = None
    try:
        _wait_port(port, time.monotonic() + 30)
        reps = {i: spawn(replica_cmd(i), work / f"r{i}.log", env) for i in range(replicas)}
        procs += list(reps.values())
        deadline = time.monotonic() + timeout_s
        done: set[int] = set()
        while len(done) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft run timed out after {timeout_s:.0f}s:\n{tail(work / 'r0.log')}")
            for i, p in reps.items():
                if i in done or p.poll() is None:
                    continue
                if p.returncode != 0 and kill_step and i == 1 and restarted_at is None and marker.exists():
                    restarted_at = time.time()  # relaunch at once, as torchrun / Slurm would
                    reps[i] = spawn(replica_cmd(i, first=False), work / f"r{i}.log", env)
                    procs.append(reps[i])
                elif p.returncode != 0:
                    raise RuntimeError(f"torchft replica {i} failed (rc={p.returncode}):\n{tail(work / f'r{i}.log')}")
                else:
                    done.add(i)
            if kill_step and restarted_at is not None and not stop.exists():
                # stop once the relaunched replica has committed `steps_after_heal` steps
                after = [r for r in _records(work / "r1.jsonl") if r.get("committed") and r["t_end"] > restarted_at]
                if len(after) >= steps_after_heal:
                    stop.touch()
            time.sleep(0.02)
    finally:
        for p in procs:
            kill_group(p)
    recs = {i: _records(work / f"r{i}.jsonl") for i in range(replicas)}
    out: dict[str, Any] = {
        "model": model,
        "replicas": replicas,
        "steps": steps,
        "kill_step": kill_step,
        "setting": setting,
    }
    r0 = [r for r in recs[0] if "committed" in r]
    out["survivor_losses"] = [r["loss"] for r in r0 if r["committed"]]
    out["step_time_s"] = median(
        [r["dt"] for r in r0 if r["step"] > 2 and r["committed"] and (not kill_step or r["step"] < kill_step - 1)]
    )
    if not kill_step:
        return out
    t_fault = json.loads(marker.read_text())["t"]
    before = [r for r in r0 if r["t_end"] <= t_fault and r["committed"]]
    after = [r for r in r0 if r["t_end"] > t_fault]
    first_commit = next((r for r in after if r["committed"]), None)
    gap = (first_commit["t_end"] - before[-1]["t_end"]) if first_commit and before else None
    starts = [r for r in recs[1] if r.get("event") == "start"]
    second = starts[-1] if len(starts) > 1 else None
    r1_after = [r for r in recs[1] if "committed" in r and r["t_end"] > t_fault]
    heal = next((r for r in r1_after if r["committed"]), None)
    rejoin = next(
        (
            r
            for r in after
            if r["committed"] and r["participants"] == replicas and heal and r["t_end"] >= heal["t_end"] - 1e-3
        ),
        None,
    )
    out.update(
        {
            "t_fault": t_fault,
            "survivor_gap_s": gap,
            "survivor_stall_s": (gap - out["step_time_s"]) if gap is not None and out["step_time_s"] else gap,
            "survivor_uncommitted_steps": sum(1 for r in after if not r["committed"]),
            "survivor_steps_with_fewer_participants": sum(
                1 for r in after if r["committed"] and r["participants"] < replicas
            ),
            "relaunch_s": (second["t_proc_start"] - t_fault) if second else None,
            "restart_seen_s": (restarted_at - t_fault) if restarted_at else None,
            "restarted_ready_s": (second["t_ready"] - t_fault) if second else None,
            "first_commit_s": (heal["t_end"] - t_fault) if heal else None,
            "heal_after_relaunch_s": (heal["t_end"] - second["t_proc_start"]) if heal and second else None,
            # the relaunched replica holds the healed state and starts its first step (quorum + heal done)
            "heal_s": (heal["t_quorum"] - t_fault) if heal else None,
            "relaunch_stages": (
                {
                    "relaunch_s": second["t_proc_start"] - t_fault,
                    "import_torch_s": second["t_imported"] - second["t_proc_start"],
                    "torchft_manager_and_model_s": second["t_ready"] - second["t_imported"],
                    "quorum_and_heal_s": heal["t_quorum"] - second["t_ready"],
                    "first_step_s": heal["t_end"] - heal["t_quorum"],
                }
                if heal and second
                else None
            ),
            "healed_to_step": heal["step"] if heal else None,
            "survivor_step_at_rejoin": rejoin["step"] if rejoin else None,
            "survivor_progress_during_outage": (
                (rejoin["step"] - (before[-1]["step"] if before else 0)) if rejoin else None
            ),
        }
    )
    return out


def run(quick: bool = False, *, model: str | None = None, out: Path = RESULTS) -> dict[str, Any]:
    t_start = time.time()
    model = model or ("tiny" if quick else "small")
    ok, note = availability()
    res: dict[str, Any] = {
        "part": "torchft",
        "quick": quick,
        "model": model,
        "machine": machine_info(),
        "available": ok,
        "torchft_note": note,
        "defaults": DEFAULTS,
        "tuned": TUNED,
    }
    if not ok:
        res["torchft_heal_s"] = None
        log(f"torchft: skipped: {note}")
        write_json(out / "torchft.json", res)
        return res
    steps = 16 if quick else 20
    kill = 8
    work = Path(tempfile.mkdtemp(prefix="bench-torchft-"))
    settings = [("tuned", TUNED)] if quick else [("tuned", TUNED), ("defaults", DEFAULTS)]
    runs: dict[str, Any] = {}
    try:
        for name, setting in settings:
            log(f"torchft: {model}, 2 replica groups, kill+restart group 1 at step {kill}, {name} timeouts")
            runs[name] = scenario(work / name, model=model, steps=steps, kill_step=kill, setting=setting)
        if not quick:
            log("torchft: failure-free reference run (trajectory check)")
            n_ref = max(len(r["survivor_losses"]) for r in runs.values())
            ref = scenario(work / "reference", model=model, steps=n_ref, kill_step=None, setting=TUNED)
            for r in runs.values():
                a, b = r["survivor_losses"], ref["survivor_losses"]
                n = min(len(a), len(b))
                diffs = [abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)]
                r["trajectory_max_abs_loss_diff_vs_failure_free"] = max(diffs) if diffs else None
                r["trajectory_identical_to_failure_free"] = bool(diffs) and max(diffs) == 0.0
            res["reference_step_time_s"] = ref["step_time_s"]
    except Exception as e:  # noqa: BLE001 - report the reason instead of losing the other parts
        res["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        log(f"torchft: failed: {res['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["runs"] = runs
    head = runs.get("tuned")
    res["torchft_heal_s"] = head.get("heal_s") if head else None
    if head is None:
        res["torchft_note"] = note + "; the run failed: " + res.get("error", "unknown")
    res["commands"] = {
        "harness": "python bench/torchft_peer.py" + (" --quick" if quick else ""),
        "replica": f"python bench/torchft_train.py --replica-id I --lighthouse URL --model {model} "
        f"--steps {steps} [--kill-at-step {kill} --marker FILE] --step-log FILE",
    }
    res["elapsed_s"] = round(time.time() - t_start, 1)
    report(res, out)
    return res


def report(res: dict[str, Any], out: Path) -> None:
    rows = []
    for name, r in res.get("runs", {}).items():
        rows.append(
            [
                name,
                r["model"],
                r["step_time_s"],
                r.get("survivor_stall_s"),
                r.get("survivor_uncommitted_steps"),
                r.get("survivor_steps_with_fewer_participants"),
                r.get("relaunch_s"),
                r.get("heal_s"),
                r.get("first_commit_s"),
                r.get("heal_after_relaunch_s"),
                r.get("trajectory_max_abs_loss_diff_vs_failure_free"),
            ]
        )
    table(
        f"torchft ({res['torchft_note']}): 2 replica groups, group 1 killed and relaunched",
        [
            "timeouts",
            "model",
            "step_s",
            "survivor_stall_s",
            "uncommitted",
            "steps_shrunk",
            "relaunch_s",
            "heal_s",
            "first_commit_s",
            "after_relaunch_s",
            "max_loss_diff",
        ],
        rows,
    )
    print(f"torchft_heal_s = {res.get('torchft_heal_s')}", flush=True)
    write_json(out / "torchft.json", res)
    try:
        plot(res, out / "torchft.png")
    except Exception as e:  # noqa: BLE001
        log(f"torchft: plot failed: {e}")


def plot(res: dict[str, Any], path: Path) -> None:
    runs = res.get("runs", {})
    if not runs:
        return
    p = plt()
    fig, ax = p.subplots(figsize=(8, 3.5))
    names = list(runs)
    for i, n in enumerate(names):
        r = runs[n]
        ax.barh(i, r.get("survivor_stall_s") or 0, color="tab:red", label="survivor stall" if i == 0 else None)
        ax.barh(
            i + 0.35,
            r.get("heal_s") or 0,
            height=0.3,
            color="tab:blue",
            label="fault -> relaunched replica healed (ready)" if i == 0 else None,
        )
    ax.set_yticks([i + 0.17 for i in range(len(names))], [f"torchft, {n} timeouts" for n in names])
    ax.set_xlabel("seconds")
    ax.set_title(f"torchft: one of 2 replica groups killed and relaunched ({res['model']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    p.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    run(a.quick, model=a.model, out=Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
