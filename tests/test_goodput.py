"""The goodput accounting (observe/goodput.py) over generated timelines: the parts sum to the wall time,
none is negative, overlapping records are counted once, and each instant goes where a brute-force
labelling of the timeline, one time unit at a time, puts it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from phoenixft.observe.goodput import CAUSES, CLASS_CAUSE, PRIORITY, account, summary_line

CASES = 300


def _steps(rng: random.Random, t: int, n: int) -> tuple[list[dict[str, Any]], int]:
    """`n` steps from time `t` on, integer start and length, with gaps; returns them and the end."""
    out = []
    for s in range(1, n + 1):
        t += rng.choice((0, 0, 1, 2))
        dt = rng.randint(1, 4)
        out.append({"step": s, "dt": dt, "t_end": t + dt, "loss": 1.0, "epoch": 0})
        t += dt
    return out, t


def _recovery(rng: random.Random, t0: int, steps: list[dict[str, Any]], klass: str = "permanent",
              action: str = "hotswap") -> dict[str, Any]:
    rep, dec = t0 + rng.randint(0, 3), 0
    dec = rep + rng.randint(0, 2)
    rc, rp, ro = rng.randint(0, 2), rng.randint(0, 2), rng.randint(0, 2)
    joined = dec + rc + rp + ro + rng.randint(0, 2)
    first = joined + rng.randint(1, 5)
    before = [r["step"] for r in steps if r["t_end"] <= t0]
    resumed = rng.choice(before) if before else 0
    return {"class": klass, "action": action, "epoch": 1, "resumed_step": resumed,
            "stages": {"reconfigure_s": rc, "restore_params_s": rp, "restore_optimizer_s": ro},
            "times": {"fault": t0, "first_report": rep, "decided": dec, "joined": joined, "first_step": first}}


def _oracle_spans(steps: list[dict[str, Any]], recs: list[dict[str, Any]], events: list[dict[str, Any]],
                  launch: int) -> list[tuple[int, int, str]]:
    """The labelled intervals as the module docstring defines them, written out plainly."""
    spans = [(r["t_end"] - r["dt"], r["t_end"], "productive") for r in steps]
    ends = {r["step"]: r["t_end"] for r in steps}
    for r in recs:
        t, st = r["times"], r["stages"]
        whole = CLASS_CAUSE.get((r["class"], r["action"])) or CLASS_CAUSE.get(r["class"])
        a = t["decided"]
        cuts = [("detection", t["fault"], t["first_report"]), ("decide", t["first_report"], t["decided"])]
        for name, key in (("reconfigure", "reconfigure_s"), ("restore_params", "restore_params_s"),
                          ("restore_optimizer", "restore_optimizer_s")):
            b = min(t["joined"], a + st[key])
            cuts.append((name, a, b))
            a = b
        cuts += [("join", a, t["joined"]), ("first_step", t["joined"], t["first_step"])]
        spans += [(x, y, whole or name) for name, x, y in cuts if y > x]
        if r["resumed_step"] in ends and ends[r["resumed_step"]] < t["fault"]:
            spans.append((ends[r["resumed_step"]], t["fault"], whole or "replayed_steps"))
    for ev in events:
        cause = {"health_check": "health_check", "spare_wait": "spare_wait"}[ev["kind"]]
        spans.append((ev["t"] - ev["duration_s"], ev["t"], cause))
    if steps:
        spans.append((launch, min(r["t_end"] - r["dt"] for r in steps), "startup"))
    return spans


def _brute(spans: list[tuple[int, int, str]], lo: int, hi: int) -> dict[str, float]:
    out = dict.fromkeys([*CAUSES, "productive"], 0.0)
    for k in range(lo, hi):
        covering = [c for a, b, c in spans if a <= k < b]
        out[min(covering, key=PRIORITY.index) if covering else "overhead"] += 1.0
    return out


def _timeline(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], int]:
    rng = random.Random(seed)
    launch = 0
    steps, end = _steps(rng, rng.randint(0, 5), rng.randint(0, 12))
    recs = []
    for _ in range(rng.randint(0, 3)):
        klass, action = rng.choice([("permanent", "hotswap"), ("transient", "inplace"), ("planned", "drain"),
                                    ("planned", "grow"), ("straggler", "drain"), ("permanent", "shrink")])
        recs.append(_recovery(rng, rng.randint(0, max(1, end)), steps, klass, action))
    events = []
    for _ in range(rng.randint(0, 3)):
        t = rng.randint(1, max(2, end + 3))
        events.append({"kind": rng.choice(["health_check", "spare_wait"]), "t": t, "duration_s": rng.randint(-2, t)})
    return steps, recs, events, launch


@pytest.mark.parametrize("chunk", range(3))
def test_generated_timelines_match_a_brute_force_labelling(chunk: int) -> None:
    for seed in range(chunk * CASES, (chunk + 1) * CASES):
        steps, recs, events, launch = _timeline(seed)
        g = account(steps, recs, events, t_launch=launch)
        spans = _oracle_spans(steps, recs, events, launch)
        hi = int(round(g["t_end"]))
        assert hi == max([launch] + [b for _, b, _ in spans]), seed
        want = _brute(spans, launch, hi)
        got = {**g["badput_s"], "productive": g["productive_s"]}
        assert got == pytest.approx(want, abs=1e-9), (seed, got, want)
        # the parts sum to the wall time; none is negative; goodput is a share
        assert sum(g["badput_s"].values()) + g["productive_s"] == pytest.approx(g["wall_s"], abs=1e-9), seed
        assert min([g["productive_s"], *g["badput_s"].values()]) >= 0.0, seed
        if g["goodput"] is not None:
            assert 0.0 <= g["goodput"] <= 1.0 + 1e-12, seed
        # a record given twice is counted once
        assert account(steps + steps, recs + recs, events + events, t_launch=launch) == g, seed


def test_clean_run_goodput_is_step_time_over_time_since_first_step() -> None:
    steps = [{"step": s, "dt": 0.5, "t_end": 10.0 + s * 0.6} for s in range(1, 11)]  # 0.1 s between steps
    g = account(steps, t_launch=8.0)
    since = steps[-1]["t_end"] - (steps[0]["t_end"] - 0.5)
    assert g["goodput"] == pytest.approx(5.0 / since)
    assert g["badput_s"]["startup"] == pytest.approx(10.1 - 8.0)
    assert g["badput_s"]["overhead"] == pytest.approx(0.9)
    assert g["goodput_incl_startup"] == pytest.approx(5.0 / (steps[-1]["t_end"] - 8.0))
    assert "goodput" in summary_line(g) and "overhead" in summary_line(g)


def test_a_failure_costs_goodput_and_names_its_causes() -> None:
    steps = [{"step": s, "dt": 1.0, "t_end": float(s)} for s in range(1, 11)]
    # steps 1-5 ran, a fault at 5.5 discarded step 5 (resumed from 4): 6 s of recovery, steps 5-10 again after it
    late = [{"step": s, "dt": 1.0, "t_end": 12.5 + s - 5} for s in range(5, 11)]
    rec = {"class": "permanent", "action": "hotswap", "resumed_step": 4, "epoch": 1,
           "stages": {"reconfigure_s": 1.0, "restore_params_s": 1.0, "restore_optimizer_s": 0.5},
           "times": {"fault": 5.5, "first_report": 6.5, "decided": 7.0, "joined": 10.0, "first_step": 12.5}}
    clean = account(steps, t_launch=0.0)
    hit = account(steps[:4] + late, [rec], t_launch=0.0)
    assert hit["goodput"] < clean["goodput"] == pytest.approx(1.0)
    b = hit["badput_s"]
    assert b["replayed_steps"] == pytest.approx(1.5)  # step 5's first execution and half of step 6's
    assert (b["detection"], b["decide"], b["reconfigure"], b["restore_params"], b["restore_optimizer"], b["join"]) \
        == pytest.approx((1.0, 0.5, 1.0, 1.0, 0.5, 0.5))
    assert b["first_step"] == pytest.approx(1.5)  # joined at 10, the first step started at 11.5
    assert hit["productive_s"] == pytest.approx(10.0)
    # the same recovery as a drain: one cause, nothing replayed or detected
    drain = account(steps[:4] + late, [{**rec, "class": "planned", "action": "drain"}], t_launch=0.0)
    assert drain["badput_s"]["drain"] == pytest.approx(7.5)  # fault to the first step, and the work it discarded
    assert drain["badput_s"]["detection"] == drain["badput_s"]["replayed_steps"] == 0.0


def test_slow_steps_beyond_the_median_are_the_stragglers() -> None:
    steps = [{"step": s, "dt": 3.0 if 6 <= s <= 8 else 1.0, "t_end": 0.0} for s in range(1, 11)]
    t = 0.0
    for r in steps:
        t += r["dt"]
        r["t_end"] = t
    g = account(steps, [], [{"kind": "straggler", "t": 5.0, "node": "n1", "from_step": 6, "to_step": 8}], t_launch=0.0)
    assert g["badput_s"]["straggler"] == pytest.approx(6.0)
    assert g["productive_s"] == pytest.approx(10.0)
    assert account(steps, t_launch=0.0)["badput_s"]["straggler"] == 0.0  # nobody reported slow: plain steps


def test_spare_wait_ends_at_the_decision_of_its_recovery() -> None:
    steps = [{"step": 1, "dt": 1.0, "t_end": 1.0}, {"step": 2, "dt": 1.0, "t_end": 20.0}]
    rec = {"class": "permanent", "action": "hotswap", "resumed_step": 1, "epoch": 1, "stages": {},
           "times": {"fault": 2.0, "first_report": 3.0, "decided": 15.0, "joined": None, "first_step": 20.0}}
    g = account(steps, [rec], [{"kind": "waiting_for_spares", "t": 4.0, "epoch": 0}], t_launch=0.0)
    assert g["badput_s"]["spare_wait"] == pytest.approx(11.0)
    assert g["badput_s"]["decide"] == pytest.approx(1.0)


class _Store:
    """Values as the job writes them: sealed with the run key (controlplane.sealed), topologies apart."""

    def __init__(self) -> None:
        from phoenixft.controlplane import sealed

        self.kv: dict[str, bytes] = {}
        sealed.bind("t" * 32, "rid")

    def set(self, key: str, value: Any) -> None:
        from phoenixft.controlplane import sealed

        self.kv[key] = json.dumps(value).encode() if key.startswith("topo/") else sealed.seal(key, json.dumps(value))

    def check(self, ks: list[str]) -> bool:
        return all(k in self.kv for k in ks)

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def get_nowait(self, key: str) -> bytes | None:
        return self.kv.get(key)

    def multi_get(self, ks: list[str]) -> list[bytes]:
        return [self.kv[k] for k in ks]


def test_live_metrics_follow_a_rollback_and_the_report_keeps_each_step_once(tmp_path: Path) -> None:
    """metrics.jsonl as the run goes: steps in order, none before the epoch that replays it wrote it (the
    store still holds the rolled-back epoch's record then), the replay appended; at the end, each step once."""
    from phoenixft.config import RunConfig
    from phoenixft.controlplane import keys
    from phoenixft.observe.live import LiveMetrics
    from phoenixft.observe.report import write_metrics

    st = _Store()
    st.set(keys.topo(0), {"nodes": ["n0", "n1"], "resume_step": 0})

    def step(s: int, epoch: int) -> dict[str, Any]:
        rec = {"step": s, "loss": 1.0 / s + epoch, "dt": 0.1, "t_end": 100.0 + s + 10 * epoch, "epoch": epoch}
        st.set(keys.step(s), rec)
        return rec

    live = LiveMetrics(RunConfig(nodes=2, steps=8), tmp_path, "127.0.0.1", 99.0, info=lambda _: None)
    lines = lambda: [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    for s in range(1, 8):
        step(s, 0)
    live.advance(st, 3)
    assert [r["step"] for r in lines()] == [1, 2, 3]  # written as the run goes, line by line
    live.advance(st, 7)
    for ev in ({"kind": "fault", "t": 107.5}, {"kind": "failures_reported", "t": 108.01, "t_first": 108.0},
               {"kind": "classified", "t": 108.2, "class": "permanent", "action": "hotswap"},
               {"kind": "recovery_planned", "epoch": 1, "resume_step": 5, "t": 108.25}):
        live.event(ev)
    during = live.account(109.0)["badput_s"]  # the recovery under way: its detection and decision so far
    assert (during["detection"], during["decide"]) == pytest.approx((0.5, 0.25))
    live.advance(st, 7)  # progress still says 7: steps 6 and 7 are epoch 0's until the replay writes them
    assert [r["step"] for r in lines()] == list(range(1, 8)) and sorted(live.steps) == [1, 2, 3, 4, 5]
    final = [step(6, 1)]
    live.advance(st, 6)
    final += [step(7, 1), step(8, 1)]
    live.advance(st, 8)
    assert [(r["step"], r["epoch"]) for r in lines()][5:] == [(6, 0), (7, 0), (6, 1), (7, 1), (8, 1)]
    g = live.account()
    assert g["steps_counted"] == 8 and g["productive_s"] == pytest.approx(0.8)
    live.close()
    canon = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][:5] + final
    write_metrics(tmp_path, canon)
    assert lines() == canon
