"""P2RStrategy(compile=...) on the model-parallel and pipeline layouts: each compiled twin (mesh_configs.py) gives
its eager twin's losses and gradient norms within the matrix's relative 1e-4, and compiled code ran in it."""

import json
from pathlib import Path

import pytest
from mesh_configs import EAGER_TWIN

TOLERANCE = 1e-4


def _report(runs: Path, name: str) -> dict:
    return json.loads((runs / f"{name}.json").read_text())


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(EAGER_TWIN))
def test_a_compiled_layout_gives_its_eager_losses_and_gradient_norms(mesh_runs: Path, name: str) -> None:
    compiled, eager = _report(mesh_runs, name), _report(mesh_runs, EAGER_TWIN[name])
    assert compiled["compiled_runs"] > 0, f"{name}: no compiled code ran"
    assert eager["compiled_runs"] == 0
    assert (compiled["path"], compiled["blocks"]) == (eager["path"], eager["blocks"])
    for key in ("losses", "grad_norms"):
        assert len(compiled[key]) == len(eager[key]) > 0
        worst = max(abs(c - e) / abs(e) for c, e in zip(compiled[key], eager[key]))
        assert worst < TOLERANCE, (name, key, compiled[key], eager[key])
