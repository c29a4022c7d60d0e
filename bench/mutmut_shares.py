"""The share of mutmut's mutants killed, per module, from the results of `mutmut run` (`make mutmut`).

Reads mutmut's result files (`mutants/<source>.meta`: each mutant's pytest exit code), counts per module
the mutants killed (a test failed, or the run timed out), survived, and not run, and writes the table into
docs/testing.md between `<!-- mutmut:begin -->` and `<!-- mutmut:end -->` and as JSON into
bench/results/mutmut.json. A survivor listed in `EQUIVALENT` (a mutant that behaves exactly like the
original, so no test can kill it) is counted apart, with its reason.

    python bench/mutmut_shares.py            the table (exit 1 below MIN_SHARE overall)
    python bench/mutmut_shares.py --survivors  the surviving mutants' names, not explained as equivalent
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
    **{f"{_P}{i}": _FLOAT_KEY for i in (30, 32)},
}


def results(root: Path) -> dict[str, dict[str, int | None]]:
    """module path (src/...) -> mutant name -> exit code (None: not run)."""
    out: dict[str, dict[str, int | None]] = {}
    for meta in sorted((root / "mutants" / "src").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        rel = meta.relative_to(root / "mutants").as_posix()[: -len(".meta")]
        out[rel] = dict(data.get("exit_code_by_key", {}))
    return out


def shares(res: dict[str, dict[str, int | None]]) -> list[dict[str, object]]:
    rows = []
    for mod, codes in res.items():
        killed = [k for k, c in codes.items() if c in KILLED]
        not_run = [k for k, c in codes.items() if c is None]
        equivalent = [k for k, c in codes.items() if c not in KILLED and c is not None and k in EQUIVALENT]
        survived = [k for k, c in codes.items() if c not in KILLED and c is not None and k not in EQUIVALENT]
        judged = len(killed) + len(survived)
        rows.append({"module": mod, "mutants": len(codes), "killed": len(killed), "survived": survived,
                     "equivalent": equivalent, "not_run": len(not_run),
                     "share": round(len(killed) / judged, 4) if judged else None})
    return rows


def table(rows: list[dict[str, object]]) -> str:
    out = [f"Measured with `{COMMAND}`.", "",
           "| module | mutants | killed | survived | equivalent | not run | killed share |",
           "|---|---|---|---|---|---|---|"]
    tot = {"mutants": 0, "killed": 0, "survived": 0, "equivalent": 0, "not_run": 0}
    for r in rows:
        sv, eq = len(r["survived"]), len(r["equivalent"])  # type: ignore[arg-type]
        share = "-" if r["share"] is None else f"{100 * float(r['share']):.1f}%"  # type: ignore[arg-type]
        out.append(f"| `{r['module']}` | {r['mutants']} | {r['killed']} | {sv} | {eq} | {r['not_run']} | {share} |")
        for k in ("mutants", "killed", "not_run"):
            tot[k] += int(r[k])  # type: ignore[call-overload]
        tot["survived"] += sv
        tot["equivalent"] += eq
    judged = tot["killed"] + tot["survived"]
    share = f"{100 * tot['killed'] / judged:.1f}%" if judged else "-"
    out.append(f"| all | {tot['mutants']} | {tot['killed']} | {tot['survived']} | {tot['equivalent']} | "
               f"{tot['not_run']} | {share} |")
    if EQUIVALENT:
        out += ["", "Equivalent mutants (they behave exactly like the original):", ""]
        out += [f"- `{k}`: {why}" for k, why in sorted(EQUIVALENT.items())]
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
    a = ap.parse_args(argv)
    res = results(REPO)
    if not res:
        raise SystemExit("mutmut_shares: no mutmut results under mutants/ (run `make mutmut`)")
    rows = shares(res)
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
    killed = sum(int(r["killed"]) for r in rows)  # type: ignore[call-overload]
    judged = killed + sum(len(r["survived"]) for r in rows)  # type: ignore[arg-type, misc]
    return 0 if judged and killed / judged >= MIN_SHARE else 1


if __name__ == "__main__":
    sys.exit(main())
