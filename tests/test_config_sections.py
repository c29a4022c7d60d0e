"""The run configuration in sections: its flat names, its flat JSON, its flags, and its import cost."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from phoenixft.config import (
    SECTIONS,
    ParallelismConfig,
    RunConfig,
    TrainingConfig,
    add_run_arguments,
    config_from_args,
    run_fields,
)

# The flat JSON form of a default config on a CPU host: config.json in the run directory, the report's
# `config` and the store's signed config are this object, which scripts and dashboards read.
DEFAULT_JSON = (
    '{"beta1": 0.9, "beta2": 0.95, "bucket_mb": 8.0, "chunk_mb": 4.0, "clip_grad_norm": 0.0, "control_plane": '
    '"tcpstore", "coordinators": 1, "data": "", "data_dtype": "uint16", "decay_steps": 0, "device": "cpu", "eps":'
    ' 1e-08, "eval_batches": 4, "eval_every": 0, "evict_stragglers": true, "failure_timeout": 10.0, "fence_kill":'
    ' true, "health_check": "", "health_check_timeout": 60.0, "health_gate": true, "health_max_age": 60.0, '
    '"health_recheck_every": 30.0, "inject": null, "join_timeout": 600.0, "json_events": false, "lr": 0.001, '
    '"lr_schedule": "constant", "metrics_host": "127.0.0.1", '
    '"metrics_port": -1, "micro_batch": 8, "microbatches": 0, "min_lr": 0.0, "model": '
    '"tiny", "momentum": 0.9, "nesterov": false, "nodes": 2, "optimizer": "adamw", "persist_dir": "", '
    '"persist_every": 0, "pp": 1, "precision": "fp32", "protect": "phoenix", "quarantine_after": 2, '
    '"quarantine_injected": false, "quarantine_window": 86400.0, "quiet": false, "racks": 1, '
    '"redundancy": "replicas:1", "repair_after": 0.0, '
    '"replica_transport": "auto", "replicas": 1, "report": "", "resume": "", "run_dir": "", "script": "", '
    '"script_args": [], "scrub_every": 1, '
    '"sdc_audit": "off", "sdc_audit_every": 0, "sdc_check_every": 1, "seed": 1234, "spare_arrives_at_step": 0, '
    '"spares": 1, "spike_threshold": 20.0, "spike_window": 32, "start_grace": 15.0, "steps": 20, '
    '"store_max_keys": 1000000, "store_max_mb": 1024, "store_step_records": 256, '
    '"straggler_factor": 1.3, "straggler_window": 20, "tensorboard": "", "threads": 0, "timeout": 0.0, '
    '"tls_ca": "", "tls_cert": "", "tls_key": "", "tp": 1, "warmup_steps": 0, "weight_decay": 0.1, '
    '"workers_per_node": 1, "workload": "phoenixft.gpt:workload"}'
)


def test_importing_the_config_does_not_import_torch() -> None:
    code = "import phoenixft.config, sys; assert 'torch' not in sys.modules, 'torch imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]


def test_the_json_form_is_the_flat_object_of_every_field() -> None:
    cfg = RunConfig(device="cpu")
    assert cfg.to_json() == DEFAULT_JSON
    assert {f.name for f in run_fields()} == set(json.loads(DEFAULT_JSON))
    assert len(run_fields()) == 83


def test_the_torch_free_name_lists_match_their_sources() -> None:
    """config/names.py checks flag values without importing torch: its lists are the real ones."""
    from phoenixft.config import names
    from phoenixft.distributed.device import DEVICES
    from phoenixft.optim import OPTIMIZERS, SCHEDULES
    from phoenixft.train.gpt import PRESETS

    assert names.GPT_PRESETS == tuple(PRESETS) and names.OPTIMIZER_NAMES == tuple(OPTIMIZERS)
    assert names.SCHEDULE_NAMES == tuple(SCHEDULES) and names.DEVICES == tuple(DEVICES)


def test_a_bad_flag_value_is_refused_before_torch_is_imported() -> None:
    """Every section's own checks run before anything imports torch: a bad value is one line within a second
    (with torch imported first it took 3-6 s), named as the user gave it."""
    code = ("import sys, time; t = time.monotonic()\n"
            "from phoenixft.cli.main import main\n"
            "for argv in (['run', '--nodes', '-1'], ['run', '--redundancy', 'replicas:0'], ['chaos', '--lr', '-1'],\n"
            "             ['coordinator', '--host', '127.0.0.1', '--steps', '0'], ['run', '--model', 'huge'],\n"
            "             ['run', '--timeout', '-5'], ['run', '--optimizer', 'adamax']):\n"
            "    assert main(argv) == 2, argv\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print(time.monotonic() - t)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert lines == [
        "phoenixft run: error: --nodes=-1 is invalid: need at least 1 node",
        "phoenixft run: error: --redundancy='replicas:0' is invalid: K must be >= 1; valid: replicas:K (K >= 1 full "
        "copies) or ec:D+H (D >= 1 data shards per group, H >= 1 parity blocks)",
        "phoenixft chaos: error: --lr=-1.0 is invalid: must be a finite number > 0",
        "phoenixft coordinator: error: --steps=0 is invalid: must be >= 1",
        "phoenixft run: error: --model='huge' is invalid: valid presets of the built-in GPT: nano, tiny, small, "
        "medium (a --workload of your own takes any name)",
        "phoenixft run: error: --timeout=-5.0 is invalid: must be a finite number >= 0 seconds (0 = no limit)",
        "phoenixft run: error: --optimizer='adamax' is invalid: one of adamw, adam, sgd, lion"], p.stderr
    assert float(p.stdout) < 1.0, p.stdout


def test_the_json_form_round_trips() -> None:
    cfg = RunConfig(device="cpu", nodes=5, redundancy="ec:2+1", inject=["kill:node=1@step=3"], quiet=True, lr=3e-4,
                    fence_kill=False, control_plane="etcd")
    text = cfg.to_json()
    back = RunConfig.from_json(text)
    assert back == cfg and back.to_json() == text
    assert json.loads(text)["redundancy"] == "ec:2+1" and json.loads(text)["inject"] == ["kill:node=1@step=3"]
    assert RunConfig.from_json(text.encode()).training == cfg.training


def test_from_json_ignores_unknown_keys_and_defaults_the_device_to_cpu() -> None:
    data = json.loads(DEFAULT_JSON)
    del data["device"]
    data["a_field_of_a_later_version"] = 1
    assert RunConfig.from_json(json.dumps(data)).to_json() == DEFAULT_JSON


def test_flat_names_read_and_write_their_section() -> None:
    cfg = RunConfig(device="cpu", steps=7, nodes=3)
    assert cfg.steps == cfg.training.steps == 7 and cfg.nodes == cfg.parallelism.nodes == 3
    cfg.steps = 9
    cfg.control.failure_timeout = 2.5
    assert cfg.training.steps == 9 and cfg.failure_timeout == 2.5
    for f in run_fields():  # every field has its flat name, on the section the SECTIONS table says
        assert getattr(cfg, f.name) == getattr(getattr(cfg, _section_of(f.name)), f.name)


def _section_of(name: str) -> str:
    return next(attr for attr, cls, _ in SECTIONS if name in {f.name for f in dataclasses.fields(cls)})


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(TypeError, match="stepz"):
        RunConfig(stepz=3)


def test_replace_takes_flat_names_and_leaves_the_source_alone() -> None:
    cfg = RunConfig(device="cpu", nodes=4, spares=2)
    for new in (cfg.replace(nodes=3, spares=1, quiet=True), dataclasses.replace(cfg, nodes=3, spares=1, quiet=True)):
        assert (new.nodes, new.spares, new.quiet) == (3, 1, True)
        assert (cfg.nodes, cfg.spares, cfg.quiet) == (4, 2, False)
        assert new.parallelism is not cfg.parallelism and new.training == cfg.training


def test_sections_can_be_given_whole() -> None:
    cfg = RunConfig(training=TrainingConfig(steps=3), parallelism=ParallelismConfig(device="cpu", nodes=4))
    assert (cfg.steps, cfg.nodes, cfg.workers_per_node) == (3, 4, 1)  # (workers per node resolved: --tp on cpu)


@pytest.mark.parametrize("kw, redundancy, replicas", [
    ({"replicas": 2}, "replicas:2", 2),
    ({"redundancy": "replicas:3"}, "replicas:3", 3),
    ({"redundancy": "ec:2+1"}, "ec:2+1", 1),
    ({"redundancy": "replicas:0"}, "replicas:0", 1),  # (refused by validate, as --redundancy replicas:0)
])
def test_replicas_is_a_shorthand_for_redundancy(kw: dict[str, object], redundancy: str, replicas: int) -> None:
    cfg = RunConfig(device="cpu", **kw)  # type: ignore[arg-type]
    assert (cfg.redundancy, cfg.replicas) == (redundancy, replicas)


def test_the_run_flags_are_grouped_by_section_and_parse_into_the_config() -> None:
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    titles = [g.title for g in ap._action_groups]
    assert [t for _, _, t in SECTIONS] == [t for t in titles if t not in ("positional arguments", "options")]
    args = ap.parse_args(["--steps", "5", "--nodes", "3", "--redundancy", "replicas:2", "--inject",
                          "kill:node=1@step=2", "--inject", "nan:step=4", "--no-fence-kill", "--device", "cpu"])
    cfg = config_from_args(args, validate=False)
    assert (cfg.steps, cfg.nodes, cfg.replicas, cfg.fence_kill) == (5, 3, 2, False)
    assert [f.kind for f in cfg.faults] == ["kill", "nan"] and cfg.scheme.k == 2
    dests = [a.dest for a in ap._actions if a.dest != "help"]
    # one flag per field, each once (but the script's path and arguments, which `phoenixft launch` fills in)
    assert sorted(dests) == sorted(f.name for f in run_fields() if f.metadata.get("cli", True))


def test_a_config_pickles_and_copies_whole() -> None:
    import copy
    import pickle

    cfg = RunConfig(device="cpu", nodes=3, inject=["nan:step=2"])
    for other in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert other == cfg and other.to_json() == cfg.to_json()
        other.nodes = 5
        assert cfg.nodes == 3
