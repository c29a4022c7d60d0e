"""`--config job.toml` for `phoenixft run`, `launch`, `coordinator`, `chaos` and `agent`: every flag a key of its
section, the command line over the file, unknown keys refused naming the valid ones, `--print-config` writing the
effective file (read back to the same configuration), the TOML writer over thousands of generated values, and a
run driven by a file."""

from __future__ import annotations

import json
import math
import random
import tomllib
from pathlib import Path

import pytest

from phoenixft.cli.main import CONFIG_COMMANDS, _config_given, _subparser, build_parser, main
from phoenixft.config.tomlfile import dump, flag_table

ROOT = Path(__file__).resolve().parents[1]


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_every_flag_is_a_key_and_the_printed_file_reads_back_the_same(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ap = build_parser()
    sub = _subparser(ap, command)
    table = flag_table(sub, command)
    flags = {a.dest for a in sub._actions if a.option_strings and a.dest not in ("help", "config", "print_config")}
    assert {fk.action.dest for fk in table.values()} == flags  # every flag of the command has its key
    required = ["--coordinator", "h:1", "--node", "a"] if command == "agent" else []
    script = [str(ROOT / "examples" / "ddp_script_phoenixft.py")] if command == "launch" else []  # (after the flags)
    text = _printed(capsys, command, *required, "--print-config", *script)
    data = tomllib.loads(text)
    keys = {(s, k) for s, body in data.items() for k in body}
    assert keys == {k for k in table if k[1] != "token"}, keys ^ set(table)  # (a token is never written)
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert _printed(capsys, command, "--config", str(path), "--print-config", *script) == text  # (required: the file's)


def test_launch_reads_its_own_config_and_leaves_the_scripts_to_the_script(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`phoenixft launch --config job.toml train.py --config theirs.yaml`: the first is phoenixft's, the second the
    script's (everything after the script's path is its own), also past a flag's value that looks like a path."""
    ap = build_parser()
    assert _config_given(ap, ["launch", "--config", "job.toml", "t.py", "--config", "x"]) == ("launch", "job.toml")
    assert _config_given(ap, ["launch", "--nodes", "3", "t.py", "--config", "x"]) is None
    assert _config_given(ap, ["launch", "--persist-dir", "d", "--config=j.toml", "t.py"]) == ("launch", "j.toml")
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\nnodes = 3\nspares = 2\n[launch]\nport = 29611\n")
    script = str(ROOT / "examples" / "ddp_script_phoenixft.py")
    got = tomllib.loads(_printed(capsys, "launch", "--config", str(path), "--spares", "1", "--print-config", script,
                                 "--config", "theirs.yaml"))
    assert (got["parallelism"]["nodes"], got["parallelism"]["spares"], got["launch"]["port"]) == (3, 1, 29611)
    assert "nnodes" not in json.dumps(got)  # (torchrun's aliases are flags, not keys)


def test_the_command_line_overrides_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[training]\nsteps = 7\nlr = 3\n[parallelism]\nnodes = 3\n[injection]\n'
                    'inject = ["kill:node=1@step=3", "hang:node=0@step=5"]\n[control]\nfence_kill = false\n'
                    'evict_stragglers = false\n[run]\ndry_run = true\n')
    got = tomllib.loads(_printed(capsys, "run", "--config", str(path), "--print-config"))
    assert (got["training"]["steps"], got["training"]["lr"], got["parallelism"]["nodes"]) == (7, 3.0, 3)
    assert got["injection"]["inject"] == ["kill:node=1@step=3", "hang:node=0@step=5"]
    assert got["control"]["fence_kill"] is False and got["control"]["evict_stragglers"] is False
    assert got["run"]["dry_run"] is True
    got = tomllib.loads(_printed(capsys, "run", "--config", str(path), "--nodes", "4", "--inject",
                                 "crash:rank=0@step=2", "--evict-stragglers", "--print-config"))
    assert (got["training"]["steps"], got["parallelism"]["nodes"]) == (7, 4)
    assert got["injection"]["inject"] == ["crash:rank=0@step=2"]  # (the command line's list replaces the file's)
    assert got["control"]["evict_stragglers"] is True


@pytest.mark.parametrize("text, needle", [
    ("[training]\nstepz = 3\n", "[training] has no key 'stepz'; valid keys of [training]: steps, model, workload"),
    ("[training]\nnodes = 3\n", "[training] has no key 'nodes' (it belongs in [parallelism]); valid keys of"),
    ("steps = 3\n", "key 'steps' is outside any section: it belongs in [training] (sections: training, "
                    "parallelism, protection, control, health, injection, output, run)"),
    ("[trainng]\nsteps = 3\n", "unknown section [trainng] (valid sections here: training, parallelism"),
    ('[training]\nsteps = "3"\n', '[training] steps = "3" is invalid: expected an integer (the flag --steps)'),
    ("[training]\nsteps = true\n", "[training] steps = true is invalid: expected an integer"),
    ("[control]\nfence_kill = 1\n", "[control] fence_kill = 1 is invalid: expected true or false"),
    ('[injection]\ninject = "kill:node=1@step=3"\n', "expected a list of strings (the flag --inject)"),
    ('[run]\ntoken = "abc"\n', "[run] token: a job token does not belong in a config file"),
    ('[coordinator]\nhost = "x"\n', "unknown section [coordinator] (valid sections here:"),
    ("[training\n", "is not valid TOML: Expected ']'"),
])
def test_a_bad_file_is_one_line_naming_the_key(text: str, needle: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    capsys.readouterr()
    assert main(["run", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("phoenixft run: error: "), err
    assert main(["run", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot be read: No such file or directory" in capsys.readouterr().err


def test_a_run_driven_by_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file gives the job, the command line a change: the run's config is both, in that order."""
    path = tmp_path / "job.toml"
    path.write_text(f'[training]\nsteps = 3\nmodel = "nano"\nmicro_batch = 2\n[parallelism]\nnodes = 3\nspares = 0\n'
                    f'[output]\nquiet = true\nrun_dir = "{tmp_path / "run"}"\n')
    capsys.readouterr()
    assert main(["run", "--config", str(path), "--nodes", "2"]) == 0, capsys.readouterr().err
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (cfg["steps"], cfg["model"], cfg["nodes"], cfg["spares"]) == (3, "nano", 2, 0)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["state"] == "done"


def _random_value(rng: random.Random) -> object:
    pick = rng.randrange(6)
    if pick == 0:
        return rng.random() < 0.5
    if pick == 1:
        return rng.randint(-2**63, 2**63 - 1) if rng.random() < 0.3 else rng.randint(-1000, 1000)
    if pick == 2:
        return rng.choice([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-300, 5e-324, 1.7976931348623157e308,
                           rng.uniform(-1e6, 1e6), rng.random() * 10 ** rng.randint(-30, 30)])
    if pick == 3:
        return "".join(chr(rng.choice([rng.randint(0, 0x7f), rng.randint(0x80, 0xd7ff), rng.randint(0xe000, 0x10ffff)]))
                       for _ in range(rng.randint(0, 12)))
    return [_random_value(rng) for _ in range(rng.randint(0, 4)) if True] if pick == 4 else \
        ["".join(rng.choice('ab"\\\n\t=[]#') for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 3))]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_the_toml_writer_reads_back_what_it_wrote() -> None:
    """Flat sections of scalars and lists, over 3,000 generated files (control characters, quotes and
    backslashes, astral code points, inf/nan/-0.0/subnormal floats, 64-bit integers, nested lists)."""
    rng = random.Random(2024)
    for _ in range(3000):
        sections = {f"s{i}": [(f"k{j}", _random_value(rng), rng.choice(["", "a comment", "x" * 150]))
                              for j in range(rng.randint(0, 5))] for i in range(rng.randint(1, 4))}
        text = dump(sections)
        back = tomllib.loads(text)
        for name, items in sections.items():
            assert set(back[name]) == {k for k, _, _ in items}, text
            for key, value, _ in items:
                assert _same(back[name][key], value), (key, value, back[name][key], text)
