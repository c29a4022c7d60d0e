"""examples/hf_gpt2.py: a HuggingFace GPT2LMHeadModel trained under phoenixft, through a node kill, then exported.

    .venv/bin/python -m pytest -q tests/test_hf_example.py

Skipped when `transformers` does not import (it is optional: `pip install transformers`).
Two 8-step runs of `--workload hf_gpt2:workload` on 2 nodes (examples/ on PYTHONPATH): a
failure-free unprotected one, and one where node 1 is SIGKILLed at step 5 and the warm spare
takes over; their final state hashes must be equal. Then `phoenixft export` of the faulted run,
`load_state_dict` into a fresh GPT2LMHeadModel (both keys of the tied embedding / lm_head are
in the file), `save_pretrained` and `from_pretrained`: the logits of one forward pass must be
identical, and the reloaded model must reproduce the run's last validation loss.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import on_pythonpath, run

try:
    import transformers  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
    pytest.skip(f"transformers is not importable ({type(e).__name__}: {e}); pip install transformers",
                allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 8


@pytest.fixture()
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    on_pythonpath(str(EXAMPLES), monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever


@pytest.mark.slow
def test_hf_gpt2_survives_a_node_kill_and_round_trips_through_save_pretrained(
    tmp_path: Path, examples_on_path: None
) -> None:
    import hf_gpt2
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from phoenixft.data import _mix

    kw: dict[str, Any] = {"workload": "hf_gpt2:workload", "nodes": 2, "steps": STEPS, "micro_batch": 4,
                          "eval_every": 4, "eval_batches": 2}
    clean = run(tmp_path / "clean", protect="none", spares=0, **kw)
    swap = run(tmp_path / "swap", spares=1, inject=["kill:node=1@step=5,phase=backward"], **kw)
    assert clean["state"] == "done", clean.get("error")
    assert swap["state"] == "done", swap.get("error")
    # a hot-swap; it may replay the last step when that step's replication had not committed yet
    (rec,) = swap["recoveries"]
    assert rec["action"] == "hotswap" and rec["lost_steps"] <= 1 and all(rec["invariants"].values()), rec
    assert swap["final_state_sha256"] == clean["final_state_sha256"]

    out = tmp_path / "model.safetensors"
    p = subprocess.run([sys.executable, "-m", "phoenixft", "export", str(tmp_path / "swap"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    sd = load_file(str(out))
    assert "lm_head.weight" in sd and torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])

    model = hf_gpt2.to_pretrained(out, tmp_path / "pretrained")
    for k, v in sd.items():
        assert torch.equal(model.state_dict()[k], v), k
    again = GPT2LMHeadModel.from_pretrained(str(tmp_path / "pretrained"))
    model.eval()
    again.eval()
    x = torch.randint(0, 256, (2, hf_gpt2.BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=x).logits, again(input_ids=x).logits
    assert torch.equal(a, b)

    # the exported weights are the trained ones: they reproduce the run's last validation loss
    metrics = [json.loads(x) for x in (tmp_path / "swap" / "metrics.jsonl").read_text().splitlines()]
    val = [m["val_loss"] for m in metrics if m.get("val_loss") is not None]
    assert len(val) >= 2, metrics
    from phoenixft.workload import WorkloadContext, load_workload

    wl = load_workload("hf_gpt2:workload", WorkloadContext(seed=1234, micro_batch=4, model="tiny", microbatches=2))
    assert wl.eval_batch is not None
    total = 0.0
    with torch.no_grad():
        for i in range(2):
            torch.manual_seed(_mix(1234, -1, i))
            total += float(wl.loss(again, wl.eval_batch(i)))
    assert math.isclose(total / 2, val[-1], rel_tol=1e-5), (total / 2, val[-1])


def test_an_hf_model_in_a_plain_loop_is_hot_swapped_bitwise(tmp_path: Path) -> None:
    """examples/hf_loop.py (the model in the user's own loop, with transformers' scheduler and gradient
    accumulation) under `phoenixft launch`: a node killed mid-backward, the final state the failure-free run's."""
    from phoenixft.cli.cmd_launch import SCRIPT_STEPS

    def launch(d: Path, **kw: Any) -> dict[str, Any]:
        return run(d, script=str(EXAMPLES / "hf_loop.py"), script_args=["--steps", str(STEPS)], steps=SCRIPT_STEPS,
                   nodes=2, spares=1, **kw)

    clean = launch(tmp_path / "clean")
    rep = launch(tmp_path / "kill", inject=["kill:node=1@step=5,phase=backward"])
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    assert rep["final_state_sha256"] == clean["final_state_sha256"]
