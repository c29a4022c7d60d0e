"""The docs cannot drift from the code: every relative link and `#anchor` in README.md and docs/*.md
resolves, every `phoenixft <command> ... --flag` they write is a flag of that command's parser, and every
`python -m phoenixft.X` they name is an importable module. No process is started."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from phoenixft.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_INLINE = re.compile(r"`([^`\n]+)`")


def _split_code(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code-block lines) of a markdown file."""
    prose: list[str] = []
    code: list[str] = []
    in_code = False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_code = not in_code
            continue
        (code if in_code else prose).append(line)
    return prose, code


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, _, - and spaces
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    prose, _ = _split_code(path.read_text())
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_anchor_rule_matches_github() -> None:
    assert github_anchor("Real data: `--data`") == "real-data---data"
    assert github_anchor("Erasure coding: `--redundancy ec:D+H`") == "erasure-coding---redundancy-ecdh"
    assert github_anchor("Across hosts and Slurm") == "across-hosts-and-slurm"


def _links() -> list[tuple[Path, str]]:
    out = []
    for doc in DOCS:
        prose, _ = _split_code(doc.read_text())
        for line in prose:
            line = _INLINE.sub("", line)  # a link written inside code is not a link
            out.extend((doc, target) for target in _LINK.findall(line))
    return out


LINKS = _links()


def test_the_docs_have_links() -> None:
    assert len(DOCS) >= 15 and len(LINKS) >= 40, (len(DOCS), len(LINKS))


@pytest.mark.parametrize("doc, target", LINKS, ids=[f"{d.name}:{t}" for d, t in LINKS])
def test_relative_links_and_anchors_resolve(doc: Path, target: str) -> None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return
    path_part, _, anchor = target.partition("#")
    dest = (doc.parent / path_part).resolve() if path_part else doc
    assert dest.exists(), f"{doc.name}: link to a missing file: {target}"
    if anchor:
        assert dest.suffix == ".md", f"{doc.name}: anchor into a non-markdown file: {target}"
        assert anchor in anchors_of(dest), f"{doc.name}: no heading gives #{anchor} in {dest.name}"


# --- commands written in the docs ---------------------------------------------------------------------

def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _command_texts() -> list[tuple[Path, str]]:
    """Every command line of the docs: code-block lines (continuations joined) and inline code."""
    out: list[tuple[Path, str]] = []
    for doc in DOCS:
        prose, code = _split_code(doc.read_text())
        joined: list[str] = []
        buf = ""
        for line in code:
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            joined.append(buf + line)
            buf = ""
        for line in joined:
            if "phoenixft " in line or "python -m phoenixft" in line:
                out.append((doc, line.split("  #")[0].split(" # ")[0]))
        for line in prose:
            out.extend((doc, m) for m in _INLINE.findall(line) if "phoenixft " in m or "-m phoenixft" in m)
    return out


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in an abridged example
        return text.split()


def _phoenixft_invocations(text: str) -> list[list[str]]:
    """The argument lists after each `phoenixft` word of a command line."""
    toks = _tokens(text)
    out = []
    for i, t in enumerate(toks):
        if t == "phoenixft" or t.endswith("/phoenixft"):
            rest = []
            for u in toks[i + 1:]:
                if u in ("|", "&&", "||", ";", "&") or u.startswith(("2>", ">")):
                    break
                rest.append(u)
            out.append(rest)
    return out


COMMANDS = _command_texts()
PARSER = build_parser()


def _flag_problems(argv: list[str]) -> list[str]:
    subs = _subparsers(PARSER)
    if not argv or argv[0] not in subs:
        return []  # prose such as "phoenixft protects", or a bare `phoenixft`
    parser = subs[argv[0]]
    problems = []
    rest = argv[1:]
    nested = _subparsers(parser)
    if nested and rest and rest[0] in nested:  # phoenixft simulate scale-sweep --calibrate ...
        parser, rest = nested[rest[0]], rest[1:]
    known = set(parser._option_string_actions)
    for tok in rest:
        if argv[0] == "launch" and tok.endswith(".py"):  # the script's path: the flags after it are the script's
            break
        if tok.startswith("--") and len(tok) > 2:
            flag = tok.split("=", 1)[0]
            flag = re.sub(r"[^\w-].*$", "", flag)  # `--persist-every/--persist-dir` -> --persist-every
            if flag not in known:
                problems.append(f"{' '.join(argv[:1])}: unknown flag {flag}")
    return problems


def test_the_docs_write_commands() -> None:
    assert sum(1 for _, t in COMMANDS for _ in _phoenixft_invocations(t)) >= 40


@pytest.mark.parametrize("doc, text", COMMANDS, ids=[f"{d.name}:{t[:60]}" for d, t in COMMANDS])
def test_every_flag_written_is_accepted(doc: Path, text: str) -> None:
    problems = [p for argv in _phoenixft_invocations(text) for p in _flag_problems(argv)]
    assert not problems, f"{doc.name}: {text!r}: {problems}"


def test_the_flag_check_can_fail() -> None:
    assert _flag_problems(["run", "--nodes", "2", "--no-such-flag"]) == ["run: unknown flag --no-such-flag"]
    assert _flag_problems(["agent", "--steps", "3"])  # a flag of `run`, not of `agent`
    assert not _flag_problems(["run", "--inject", "kill:node=1@step=3"])
    assert not _flag_problems(["launch", "--nodes", "2", "train.py", "--steps", "3"])  # (the script's own flag)
    assert _flag_problems(["launch", "--steps", "3", "train.py"])  # (before the script: phoenixft's, and unknown)


def _modules() -> list[tuple[Path, str]]:
    out = []
    for doc in DOCS:
        for m in re.findall(r"python3? -m (phoenixft(?:\.\w+)*)", doc.read_text()):
            out.append((doc, m))
    return out


MODULES = _modules()


@pytest.mark.parametrize("doc, module", MODULES, ids=[f"{d.name}:{m}" for d, m in MODULES])
def test_python_m_modules_exist(doc: Path, module: str) -> None:
    assert importlib.util.find_spec(module) is not None, f"{doc.name}: python -m {module}: no such module"


def test_the_module_check_can_fail() -> None:
    assert importlib.util.find_spec("phoenixft.runtime.zygote") is not None
    assert importlib.util.find_spec("phoenixft.zygote") is None  # the module's place before the role packages


_PATH = re.compile(r"\b(?:src/phoenixft|tests|bench|examples)/[\w./-]+\.(?:py|sh|json|md)\b")
_PACKAGE_PATH = re.compile(r"`((?:runtime|controlplane|coordinator|dist|train|parallel|protect|recovery|faults|observe|"
                           r"config|sim|cli|optim)/[\w/]+\.py)`")


def _paths() -> list[tuple[Path, str]]:
    """Files of the repository the docs name: `src/...`, `tests/...`, `bench/...` paths, and
    `package/module.py` inside src/phoenixft."""
    out = []
    for doc in DOCS + [ROOT / "CHANGELOG.md"]:
        text = doc.read_text()
        out += [(doc, p) for p in sorted(set(_PATH.findall(text)))]
        out += [(doc, "src/phoenixft/" + p) for p in sorted(set(_PACKAGE_PATH.findall(text)))]
    return out


PATHS = _paths()


def test_the_docs_name_files() -> None:
    assert len(PATHS) > 50


@pytest.mark.parametrize("doc,path", PATHS, ids=[f"{d.name}:{p}" for d, p in PATHS])
def test_files_named_in_the_docs_exist(doc: Path, path: str) -> None:
    assert (ROOT / path).exists(), f"{doc.name} names {path}, which is not in the repository"


# --- figures and flags written from their sources ---------------------------------------------------------

BENCH = ROOT / "bench"


def _figures() -> object:
    import sys

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import figures

    return figures


def test_the_measured_figures_are_the_results_files() -> None:
    """Every figures block of README.md and docs/benchmarks.md says what its files in bench/results/ say
    (`python bench/figures.py --write` writes them; a benchmark run does)."""
    assert _figures().check() == []  # type: ignore[attr-defined]


# A measured figure: a decimal with a unit or a ratio sign, a percentage, or a bold number. Outside the figures
# blocks, code and inline code, these documents may hold only the settings below (parameters, not results).
_FIGURE = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*\.\d+\s?(?:s|ms|us|GB/s|MB/s|GB|MB|MiB|GiB|x|%)(?![\w/])"
                     r"|\d+(?:\.\d+)?%|\d+\.\d+x\b|\*\*\d[\d.,]*\*\*)")
_SETTINGS = {"0.25 s", "95%", "4.4x", "10%"}  # a poll interval, the intervals' level, a target and its slack


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_no_measured_figure_stands_outside_a_figures_block(doc: str) -> None:
    text = (ROOT / doc).read_text()
    text = re.sub(r"<!-- figures:([\w-]+) -->.*?<!-- /figures:\1 -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    loose = [m.group(0) for m in _FIGURE.finditer(text) if m.group(0) not in _SETTINGS]
    assert loose == [], f"{doc}: figures not read from bench/results/ (a block of bench/figures.py): {loose}"


def test_results_hold_no_path_of_the_machine_that_measured_them() -> None:
    figures = _figures()
    import benchlib  # (on the path with bench/figures.py)

    paths = [p for p, _ in benchlib.machine_paths()] + ["/work/", "/home/", "/root/", "/tmp/"]
    assert figures is not None
    for f in sorted((BENCH / "results").iterdir()):
        if f.suffix in (".json", ".md"):
            text = f.read_text()
            assert not [p for p in paths if p in text], f"{f.name} holds a path of this machine"


def test_the_usage_flag_tables_are_the_parsers() -> None:
    """docs/usage.md lists every flag of run, coordinator, chaos, agent, status and drain with its default and
    help, as the parsers have them (`python -m phoenixft.cli.flagdoc --write`)."""
    from phoenixft.cli import flagdoc

    assert flagdoc.check() == []
    # (a flag the parser gains shows up as a difference: the check is not vacuous)
    assert "| `--quarantine-injected` | off |" in (ROOT / "docs" / "usage.md").read_text()
    assert "| `--tls-cert` |" in flagdoc.render("run") and "| `--scrub-every` |" in flagdoc.render("run")


def test_the_readme_demo_sample_is_what_the_demo_prints(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Each line of README.md's `make demo` sample is a line the demo prints (its label; the times vary), and the
    demo prints no figure the README does not show (a step-time 'overhead' of three runs one after the other
    contradicted the measured one)."""
    import phoenixft.runtime.demo as demo

    rec = {"action": "hotswap", "recovery_s": 0.312, "lost_steps": 1, "stages": {"detect_s": 0.014},
           "invariants": {"I1": True, "I2": True, "I3": True, "I4": True}, "epoch": 1}
    fake = {"state": "done", "steps_completed": 30, "final_state_sha256": "17206c7886b9" + "0" * 52,
            "step_time_s": {"median": 0.06}, "recoveries": [], "run_dir": str(tmp_path)}
    runs = iter([fake, fake, {**fake, "recoveries": [rec]}])
    monkeypatch.setattr(demo, "run_job", lambda cfg, *a, **kw: next(runs))
    monkeypatch.setattr(demo, "check_mode", lambda cfg, local: None)
    import phoenixft.observe.html_report as html_report

    monkeypatch.setattr(html_report, "write_report", lambda *a, **kw: tmp_path / "report.html")
    assert demo.demo(steps=30, nodes=3, model="nano", kill_step=15, kill_node=1, phase="backward",
                     run_dir=str(tmp_path)) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    text = (ROOT / "README.md").read_text()
    sample = text[text.index("`make demo` trains"):].split("```")[1].strip("\n").splitlines()
    labels = {ln[:34].rstrip() for ln in printed}
    for line in sample:
        if line.strip():
            assert line[:34].rstrip() in labels, f"README's demo line {line!r} is not what the demo prints"
    assert not [ln for ln in printed if "overhead" in ln], printed
