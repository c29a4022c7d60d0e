"""The share of mutmut's mutants killed, per module, from the results of `mutmut run` (`make mutmut`).

Reads mutmut's result files (`mutants/<source>.meta`: each mutant's pytest exit code), counts per module
the mutants killed (a test failed, or the run timed out), survived, and not run, and writes the table into
docs/testing.md between `<!-- mutmut:begin -->` and `<!-- mutmut:end -->` and as JSON into
bench/results/mutmut.json. A survivor listed in `EQUIVALENT` (a mutant that behaves exactly like the
original, so no test can kill it) is counted apart, with its reason.

    python bench/mutmut_shares.py            the table (exit 1 below MIN_SHARE overall)
    python bench/mutmut_shares.py --survivors  the surviving mutants' names, not explained as equivalent
    python bench/mutmut_shares.py --verify   each unexplained survivor against today's tests first (`mutmut apply`,
                                             the module's VERIFY_TESTS, the file restored)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "testing.md"
OUT = REPO / "bench" / "results" / "mutmut.json"
BEGIN, END = "<!-- mutmut:begin -->", "<!-- mutmut:end -->"
MIN_SHARE = 0.90
KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # a test failed, pytest broke, or the mutant ran past its time
COMMAND = "make mutmut  # .venv/bin/python -m mutmut run --max-children 2; python bench/mutmut_shares.py"

# mutant name -> why no test can tell it from the original
_C, _P = "phoenixft.protect.redundancy.codes.", "phoenixft.protect.redundancy.placement.x_place_groups__mutmut_"
_XOR_DTYPE = ("the data blocks are uint8 arrays (the codes' contract; every caller passes uint8 views) and np.array "
              "copies by default")
_XOR_ONE = ("the message of a raise no input reaches: `_check` lets at most one lost data block through for h = 1 "
            "(d of the d + 1 pieces given, a lost block never given)")
_ZFEC_BYTES = "zfec's Decoder.decode returns bytes, so the other branch is never taken"
_INT64 = "numpy's default integer is int64 here (Linux, 64-bit): the same array"
_FLOAT_KEY = ("the parity load as float64 instead of int64: the placement key stays an exact integer below 2**53 "
              "(rings of up to a million ranks), so argmin picks the same position")
EQUIVALENT: dict[str, str] = {
    **{f"{_C}xǁXorCodeǁ_xor__mutmut_{i}": _XOR_DTYPE for i in (3, 6, 7)},
    **{f"{_C}xǁXorCodeǁdecode__mutmut_{i}": _XOR_ONE for i in (14, 15, 16, 17)},
    **{f"{_C}xǁReedSolomonǁdecode__mutmut_{i}": _ZFEC_BYTES for i in (19, 24)},
    **{f"{_P}{i}": _INT64 for i in (25, 27, 35, 37)},
    **{f"{_P}{i}": _FLOAT_KEY for i in (30, 32, 67, 69, 77)},
    f"{_P}61": "with no parity block chosen yet, np.isin against the racks of none is all False: the same array",
    f"{_P}78": ("(in_members * 3 + in_parity) orders the four cases as (in_members * 2 + in_parity) does: the same "
                "lexicographic key order"),
    f"{_P}81": "any multiplier above the largest load keeps the key lexicographic: the same order",
    f"{_P}92": "every load counted in twos: the loads compare as before, and the multiplier still exceeds them",
    "phoenixft.recovery.planner.x__in_memory__mutmut_3": (
        "`_in_memory`'s only caller, plan_recovery, always passes src_world (an int: the last topology's world or "
        "the unfinished repartition's), so the `src_world is None` default branch is never taken"),
    "phoenixft.recovery.planner.x_plan_recovery__mutmut_41": (
        "`grew` is only read as a truth value (`pi.grow_only or grew`, `grew and not pi.dead`): None and False alike"),
    "phoenixft.recovery.planner.x__in_memory__mutmut_251": (
        "the unchanged-world branch has no dropped slot (a dropped slot shortens the node list): `dropped` is [], "
        "Plan's default"),
    **{f"phoenixft.recovery.planner.x__in_memory__mutmut_{i}": (
        "the repartition branch never runs for a tp x pp mesh (it refuses to drop a node, never grows, so never "
        "carries meta['reshard']): tp = pp = 1 there, the shard names are the same") for i in (276, 277)},
    "phoenixft.recovery.planner.x_plan_recovery__mutmut_94": (
        "src_world None instead of old.world when no unfinished repartition is resumed: `_in_memory` reads None as "
        "old.world"),
    **{f"phoenixft.recovery.planner.x_plan_recovery__mutmut_{i}": (
        "meta['reshard'] is only written by a repartition, which a tp x pp mesh never does (it refuses to drop a "
        "node and never grows): tp = pp = 1 there, the shard names are the same") for i in (113, 114)},
    "phoenixft.recovery.planner.x_plan_recovery__mutmut_199": "`_in_memory` never reads its `g` argument",
    "phoenixft.recovery.planner.x__new_topo__mutmut_36": (
        "no caller passes `transfers` (the plan fills them in afterwards): `transfers or []` is [], "
        "Topology's default"),
    "phoenixft.recovery.planner.x__in_memory__mutmut_286": (
        "no worker id is '' or 'XXXX' (wids are <node>.<local rank>): preferring either picks no holder"),
    **{f"phoenixft.recovery.planner.x__split__mutmut_{i}": (
        "node ids are n<i> or s<k> (launcher, admission), without a dot: a wid <node>.<local rank> has one dot, "
        "which rsplit('.'), split('.', 1) and rsplit('.', 2) split alike") for i in (5, 6, 8)},
    "phoenixft.faults.spec.x_parse_fault__mutmut_190": (
        "a bare flag's separator is only tested for truth (`if not sep`) afterwards: '=' and 'XX=XX' alike"),
    "phoenixft.faults.scenarios.xǁKillDuringRecoveryǁdraw__mutmut_38": (
        "`other >= j` differs from `other > j` only when other == j, which happens only with spares (no mate drawn "
        "without spares returns a plain kill first), where the condition is false either way"),
}


# the fast tests each module's survivors are checked against by `--verify` (after tests were added for them)
VERIFY_TESTS: dict[str, list[str]] = {
    "src/phoenixft/protect/redundancy/codes.py": [
        "tests/test_redundancy.py::test_codes_refuse_what_they_cannot_do_saying_why",
        "tests/test_redundancy.py::test_codes_rebuild_every_erasure_pattern_bit_for_bit"],
    "src/phoenixft/protect/redundancy/placement.py": [
        "tests/test_redundancy.py::test_placement_rejects_what_cannot_be_placed",
        "tests/test_redundancy.py::test_placement_properties_over_generated_rings"],
    "src/phoenixft/faults/scenarios.py": [
        "tests/test_chaos.py::test_a_corrupt_fault_passes_only_when_recovery_rejected_the_copy_it_corrupted",
        "tests/test_chaos.py::test_each_drawn_fault_reports_what_it_is_and_whether_it_is_survivable",
        "tests/test_chaos.py::test_what_each_scenario_draws_and_says"],
    "src/phoenixft/parallel/layout.py": [
        "tests/test_mesh.py::test_each_rank_knows_its_data_parallel_index_and_its_embedding_peers",
        "tests/test_mesh.py::test_layout_is_megatron_order_and_groups_partition_the_world"],
    "src/phoenixft/faults/spec.py": ["tests/test_faults.py::test_bad_spec_is_one_line_saying_what_is_wrong",
                                     "tests/test_faults.py::test_good_specs_still_parse", "tests/test_fault_kinds.py"],
    "src/phoenixft/recovery/planner.py": ["tests/test_planner.py"],
}
VERIFIED = REPO / "bench" / "results" / "mutmut_verified.json"


def verify(res: dict[str, dict[str, int | None]]) -> dict[str, str]:
    """Each unexplained survivor of a module-level function applied to its source (`mutmut apply`), its module's
    VERIFY_TESTS run, the file restored (checked by SHA-256): mutant name -> "killed" or "survived"."""
    import hashlib
    import subprocess

    out: dict[str, str] = {}
    for mod, codes in res.items():
        # (module-level functions only: `mutmut apply` puts a mutated method into the first method of that name)
        names = [k for k, c in codes.items() if c is not None and c not in KILLED and k not in EQUIVALENT
                 and "ǁ" not in k]
        path = REPO / mod
        for name in names:
            original = path.read_bytes()
            try:
                subprocess.run([sys.executable, "-m", "mutmut", "apply", name], cwd=REPO, check=True,
                               capture_output=True, timeout=120)
                rc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                     *VERIFY_TESTS[mod]], cwd=REPO, capture_output=True, timeout=600).returncode
            finally:
                path.write_bytes(original)
                if hashlib.sha256(path.read_bytes()).digest() != hashlib.sha256(original).digest():
                    raise SystemExit(f"mutmut_shares: {path} was not restored")
            out[name] = "killed" if rc == 1 else "survived"
            print(f"{out[name]:>8}  {name}", flush=True)
    return out


def results(root: Path) -> dict[str, dict[str, int | None]]:
    """module path (src/...) -> mutant name -> exit code (None: not run)."""
    out: dict[str, dict[str, int | None]] = {}
    for meta in sorted((root / "mutants" / "src").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        rel = meta.relative_to(root / "mutants").as_posix()[: -len(".meta")]
        out[rel] = dict(data.get("exit_code_by_key", {}))
    return out


def shares(res: dict[str, dict[str, int | None]], after: dict[str, str]) -> list[dict[str, object]]:
    """Per module: killed by the run, survivors killed by tests added since (`after`, verified), survivors,
    equivalent mutants, not run; the share killed = killed / (all judged but the equivalent ones)."""
    rows = []
    for mod, codes in res.items():
        killed = [k for k, c in codes.items() if c in KILLED]
        not_run = [k for k, c in codes.items() if c is None]
        left = [k for k, c in codes.items() if c not in KILLED and c is not None]
        equivalent = [k for k in left if k in EQUIVALENT]
        later = [k for k in left if k not in EQUIVALENT and after.get(k) == "killed"]
        survived = [k for k in left if k not in EQUIVALENT and after.get(k) != "killed"]
        judged = len(killed) + len(later) + len(survived)
        rows.append({"module": mod, "mutants": len(codes), "killed": len(killed), "killed_by_new_tests": later,
                     "survived": survived, "equivalent": equivalent, "not_run": len(not_run),
                     "share_run": round(len(killed) / judged, 4) if judged else None,
                     "share": round((len(killed) + len(later)) / judged, 4) if judged else None})
    return rows


def _pct(x: object) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}%"  # type: ignore[arg-type]


def table(rows: list[dict[str, object]]) -> str:
    out = [f"Measured with `{COMMAND}`. The survivors of a run are then judged again, after tests were added "
           "for them, by `mutmut run <their names>` (the new result replaces the old one: \"killed by the run\" "
           "counts both), or, without a new run, by `python bench/mutmut_shares.py --verify` (each applied with "
           "`mutmut apply`, its module's tests run, the file restored: \"killed by tests added for survivors\"). "
           "Shares leave out the equivalent mutants and those not run.", "",
           "| module | mutants | killed by the run | killed by tests added for survivors | survived | equivalent | "
           "not run | killed share (run) | killed share |", "|---|---|---|---|---|---|---|---|---|"]
    tot = dict.fromkeys(("mutants", "killed", "later", "survived", "equivalent", "not_run"), 0)
    for r in rows:
        later, sv, eq = (len(r[k]) for k in ("killed_by_new_tests", "survived", "equivalent"))  # type: ignore[arg-type]
        out.append(f"| `{r['module']}` | {r['mutants']} | {r['killed']} | {later} | {sv} | {eq} | {r['not_run']} | "
                   f"{_pct(r['share_run'])} | {_pct(r['share'])} |")
        for k in ("mutants", "killed", "not_run"):
            tot[k] += int(r[k])  # type: ignore[call-overload]
        tot["later"] += later
        tot["survived"] += sv
        tot["equivalent"] += eq
    judged = tot["killed"] + tot["later"] + tot["survived"]
    out.append(f"| all | {tot['mutants']} | {tot['killed']} | {tot['later']} | {tot['survived']} | "
               f"{tot['equivalent']} | {tot['not_run']} | {_pct(tot['killed'] / judged if judged else None)} | "
               f"{_pct((tot['killed'] + tot['later']) / judged if judged else None)} |")
    eq_names = sorted(k for r in rows for k in r["equivalent"])  # type: ignore[attr-defined]
    if eq_names:
        out += ["", "Equivalent mutants (they behave exactly like the original):", ""]
        out += [f"- `{k}`: {EQUIVALENT[k]}" for k in eq_names]
    left = sorted(k for r in rows for k in r["survived"])  # type: ignore[attr-defined]
    if left:
        out += ["", "Surviving mutants, neither killed nor explained yet:", ""]
        out += [f"- `{k}`" for k in left]
    return "\n".join(out)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"mutmut_shares: {DOC} lacks the markers {BEGIN} / {END}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--survivors", action="store_true", help="print the unexplained survivors and exit")
    ap.add_argument("--verify", action="store_true", help="check the survivors against today's tests first")
    a = ap.parse_args(argv)
    res = results(REPO)
    if not res:
        raise SystemExit("mutmut_shares: no mutmut results under mutants/ (run `make mutmut`)")
    after: dict[str, str] = json.loads(VERIFIED.read_text()) if VERIFIED.exists() else {}
    if a.verify:
        after |= verify(res)
        VERIFIED.write_text(json.dumps(after, indent=1, sort_keys=True) + "\n")
    rows = shares(res, after)
    if a.survivors:
        for r in rows:
            for k in r["survived"]:  # type: ignore[attr-defined]
                print(k)
        return 0
    text = table(rows)
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": COMMAND, "modules": rows}, indent=1) + "\n")
    write_doc(text)
    judged = [r for r in rows if r["share"] is not None]
    killed = sum(int(r["killed"]) + len(r["killed_by_new_tests"]) for r in judged)  # type: ignore[arg-type, call-overload]
    total = killed + sum(len(r["survived"]) for r in judged)  # type: ignore[arg-type, misc]
    return 0 if total and killed / total >= MIN_SHARE else 1


if __name__ == "__main__":
    sys.exit(main())
