"""What a person sees during `phoenixft run`: a progress line, fault and recovery lines.

On a terminal the progress line redraws in place; in a log (not a TTY, or `--quiet`) a line is
printed every tenth of the run and at every evaluation. With `--eval-every` the line shows the
latest validation loss (`val X.XXXX`) from the first evaluation on. `--json-events` prints each
event as one JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from phoenixft.observe.goodput import summary_line
from phoenixft.recovery.invariants import failed_invariants, invariants_hold
from phoenixft.sdc.report import detection_line

__all__ = ["Display"]


class Display:
    def __init__(self, *, quiet: bool = False, json_events: bool = False, steps: int = 0,
                 tokens_per_step: int = 0) -> None:
        self.quiet, self.json_events, self.steps = quiet, json_events, steps
        self.tokens_per_step = tokens_per_step
        self.joins = False  # show every admission (the head of a multi-host job); refusals always show
        self.tty = sys.stderr.isatty() and not quiet
        self._t0 = time.time()
        self._last_line = 0
        self._tokens = 0
        self._val: float | None = None
        self.goodput: dict[str, Any] | None = None  # the live goodput (observe/goodput.py), set by the launcher

    def _err(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def info(self, text: str) -> None:
        self._err(text)

    def progress(self, rec: dict[str, Any]) -> None:
        s, n = rec["step"], self.steps
        el = time.time() - self._t0
        eta = el / max(1, s) * (n - s)
        tput = f"{self.tokens_per_step / rec['dt']:,.0f} tok/s  " if self.tokens_per_step and rec["dt"] > 0 else ""
        if rec.get("val_loss") is not None:
            self._val = float(rec["val_loss"])
        val = f"val {self._val:.4f}  " if self._val is not None else ""  # the latest evaluation (--eval-every)
        gp = self.goodput.get("goodput") if self.goodput else None
        good = f"goodput {gp * 100:.0f}%  " if gp is not None else ""
        line = (f"step {s}/{n}  loss {rec['loss']:.4f}  {val}{rec['dt'] * 1e3:.0f} ms/step  {tput}{good}"
                f"epoch {rec['epoch']}  world {rec['world']}  ETA {eta:.0f}s")
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        elif not self.quiet and (s == n or s - self._last_line >= max(1, n // 10) or rec.get("val_loss") is not None):
            self._last_line = s
            self._err(line)

    def event(self, ev: dict[str, Any]) -> None:
        if self.json_events:
            print(json.dumps(ev), flush=True)
        k = ev.get("kind")
        if k == "fault":
            where = (f"step {ev['step']}, phase {ev['phase']}" if "step" in ev
                     else f"during recovery epoch {ev.get('recovery')}")
            self._err(f"!! fault injected: {ev['spec']} (node {ev['node']}, {where})")
        elif k == "classified" and ev.get("drained"):
            self._err(f"== drain in epoch {ev['epoch']}: {', '.join(ev['drained'])} leaves at the step boundary "
                      f"-> class {ev['class']}, action {ev['action']}")
        elif k == "drain_requested":
            until = f", notice ends in {ev['deadline'] - ev['t']:.1f}s" if ev.get("deadline") else ""
            self._err(f"== drain of {ev['node']} requested ({ev['reason']}; from {ev['source']}{until})")
        elif k in ("drain_ignored", "drain_failed"):
            self._err(f"!! drain of {ev['node']} {'not done' if k == 'drain_ignored' else 'failed'}: {ev['why']}")
        elif k == "drain_waits_for_spare":
            self._err(f"   drain of {ev['node']} waits for a starting spare (at most {ev['at_most_s']:g}s)")
        elif k == "classified":
            extra = f", restarted in place {ev['restarted']}" if ev.get("restarted") else ""
            self._err(f"!! failure in epoch {ev['epoch']}: dead {ev['dead'] or 'none'}{extra} -> class {ev['class']}, "
                      f"action {ev['action']}")
        elif k == "recovery_planned":
            self._err(f"   epoch {ev['epoch']}: resume from step {ev['resume_step']}, promoted {ev['promoted']} "
                      f"(decided in {ev['decide_s'] * 1e3:.0f} ms)")
        elif k == "coordinator_exited":
            how = "a standby takes over, it restarts as a standby" if ev.get("standbys") else \
                "restarting it from its journal"
            self._err(f"!! coordinator exited: {how} (training continues)")
        elif k == "coordinator_restarted":
            who = "a standby coordinator leads now" if ev.get("leader") else "coordinator back"
            self._err(f"   {who} at epoch {ev['epoch']}, spare pool {ev['spare_pool']}")
        elif k == "fallback_persistent":
            self._err(f"!! in-memory state lost ({ev['reason']}): falling back to the persistent checkpoint of "
                      f"step {ev['step']}")
        elif k == "checkpoint_skipped":
            using = f"using step {ev['using']}" if ev.get("using") is not None else "no older one verifies"
            self._err(f"!! {ev['line']}; {using}")
        elif k == "spare_repaired":
            self._err(f"   {ev['replaces']} repaired: back as spare {ev['node']} (--repair-after)")
        elif k == "run_failed":
            self._err(f"!! run failed: {ev['error']}" + (f" [{ev['log']}]" if ev.get("log") else ""))
        elif k == "admitted" and self.joins:
            note = f" ({ev['note']})" if ev.get("note") else ""
            role = "spare " if ev.get("spare") else ""
            self._err(f"   {ev['name']} ({ev['host']}) joined as {role}{ev['node']}{note}")
        elif k == "join_refused":
            self._err(f"!! refused to admit {ev['name']!r} ({ev['host']}): {ev['reason']}")
        elif k == "straggler":
            then = "evicting it when a spare is ready" if ev.get("action") == "evict" else "reported only"
            self._err(f"!! straggler: {ev['node']} computes {ev['ratio']:.2f}x its peers' median since step "
                      f"{ev['first_step']} ({ev['window']} steps over {ev['factor']:g}x): {then}")
        elif k == "straggler_evicted":
            self._err(f"   evicting straggler {ev['node']} after step {ev['step']}: spare {ev['spare']} takes slot "
                      f"{ev['slot']}")
        elif k == "straggler_kept":
            self._err(f"   straggler {ev['node']} stays for now: {ev['why']}")
        elif k == "scrub_found":
            what = {"own": "its own snapshot", "replica": "its replica", "parity": "its parity block"}.get(
                str(ev.get("copy")), "a copy")
            fix = (f"repaired: {ev['repaired_from']}" if ev.get("repaired")
                   else f"NOT repaired ({ev.get('why_not')}); no recovery will use it")
            self._err(f"!! scrub: {ev.get('node')} found {what} {ev.get('shard') or ''} of step {ev.get('step')} "
                      f"corrupt at rest; {fix}")
        elif k == "fault_failed":
            self._err(f"!! fault {ev['spec']} could not be injected on {ev['node']}: {ev['error']}")
        elif k in ("sdc_detected", "sdc_verdict"):
            self._err(detection_line(ev) or "")

    @staticmethod
    def _inv(r: dict[str, Any]) -> str:
        if invariants_hold(r):
            return "ok"
        bad = ", ".join(failed_invariants(r))
        why = f" ({'; '.join(r.get('i3_failures', [])[:2])})" if r.get("i3_failures") else ""
        if r.get("completed_in_epoch", r["epoch"]) is None:  # (report.py: the next recovery failed)
            return f"{bad} not established in epoch {r['epoch']}{why}: another failure interrupted it, and its " \
                   "recovery failed"
        if r.get("completed_in_epoch", r["epoch"]) != r["epoch"]:
            return f"{bad} not established in epoch {r['epoch']}{why}; recovery completed in epoch " \
                   f"{r['completed_in_epoch']}"
        return f"FAILED: {bad}{why}"

    def done(self, report: dict[str, Any]) -> None:
        if self.tty:
            sys.stderr.write("\n")
        for r in report.get("recoveries", []):
            st = r["stages"]
            fmt = lambda x: "-" if x is None else f"{x * 1e3:.0f}ms"  # noqa: E731
            # (one whose epoch was superseded by another recovery completed in that one)
            failed = not invariants_hold(r) and r.get("completed_in_epoch", r["epoch"]) in (r["epoch"], None)
            what = " + ".join(r.get("faults") or []) or r["fault"] or (
                "no fault (a planned grow)" if r.get("class") == "planned" else "failure")
            if r["action"] == "failed":  # the recovery that ended the run (report.py: _failed_recovery)
                self._err(f"   not recovered {what}: lost {', '.join(r['dead']) or 'no node'} in epoch "
                          f"{r['epoch'] - 1}, detect {fmt(st['detect_s'])}, decide {fmt(st['decide_s'])}: "
                          f"{r.get('error')}")
                continue
            self._err(f"   {'not recovered' if failed else 'recovered'} {what}: {r['action']} in "
                      f"{fmt(r['recovery_s'])} "
                      f"(detect {fmt(st['detect_s'])}, reconfigure {fmt(st['reconfigure_s'])}, "
                      f"params {fmt(st['restore_params_s'])}, optimizer {fmt(st['restore_optimizer_s'])}, "
                      f"first step {fmt(st['first_step_s'])}), lost {r['lost_steps']} step(s), "
                      f"invariants {self._inv(r)}{_drain_line(r)}")
        for st in report.get("stragglers", []):
            fate = (f"evicted after step {st['evicted_at_step']}, replaced by {st['replaced_by']}" if st["evicted"]
                    else "not evicted")
            self._err(f"   straggler {st['node']}: {st['ratio']:.2f}x its peers' median from step {st['first_step']}, "
                      f"{fate}")
        for spec in report.get("faults_not_fired", []):
            self._err(f"!! fault never fired: {spec} ({_ended_first(spec, report) or _why_not_fired(spec)})")
        if isinstance(report.get("goodput"), dict):
            self._err(f"   {summary_line(report['goodput'])}")
        state = report.get("state")
        if report.get("error_traceback"):  # an error in the user's own code: where its traceback is
            self._err(f"   error in your code at {report.get('error_where')}; its traceback: "
                      f"{report.get('error_log') or 'the log of node ' + str(report.get('error_node'))} and the "
                      "report's error_traceback")
        self._err(f"{state}: {report.get('steps_completed', 0)} steps, final state sha256 "
                  f"{(report.get('final_state_sha256') or '-')[:16]}, report in {report.get('run_dir', '-')}")


def _drain_line(r: dict[str, Any]) -> str:
    """What a recovery's drain adds to its line: notice-to-swapped time and bytes moved, or why it failed."""
    d = r.get("drain")
    if not d:
        return ""
    if not d.get("completed"):
        return f"; drain of {d.get('node')} fell back to the failure path (the node was lost first)"
    t = d.get("notice_to_swapped_s")
    return (f"; drained {d.get('node')} ({d.get('reason')}): notice to swapped "
            f"{'-' if t is None else f'{t * 1e3:.0f}ms'}, {r.get('bytes_moved', 0) / 2**20:.1f} MiB moved")


def _ended_first(spec: str, report: dict[str, Any]) -> str | None:
    """Why a fault did not fire when the run did not finish and never reached the fault's step (a timeout,
    Ctrl-C, a lost run), or None: then the fault's own kind says why (`_why_not_fired`)."""
    state = report.get("state")
    if state is None or state == "done":
        return None
    from phoenixft.faults.spec import parse_fault

    try:
        step = parse_fault(spec, 0).step
    except Exception:  # noqa: BLE001 - (specs were validated at the start; a report from elsewhere may differ)
        return None
    done = int(report.get("steps_completed") or 0)
    if step is not None and step <= done:
        return None
    return f"the run ended ({state}) after step {done}" + (f", before step {step}" if step is not None else "")


def _why_not_fired(spec: str) -> str:
    """Why an `--inject` spec can end a run without having fired: its kind says."""
    from phoenixft.faults.spec import parse_fault

    try:
        f = parse_fault(spec, 0)
    except Exception:  # noqa: BLE001 - (specs were validated at the start; a report from elsewhere may differ)
        return "its node, rank or phase was not in the job when its step came"
    return f.kind_of.why_not_fired(f)
