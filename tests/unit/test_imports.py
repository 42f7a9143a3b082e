"""What importing parts of the package costs: the layout rulebook and the planner load neither torch nor Lightning
(issue 39), and the strategies register with Lightning whichever way the package is reached."""

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_layout_rulebook_and_the_planner_import_without_torch_or_lightning() -> None:
    result = _run("import sys, lightning_p2r.layout, lightning_p2r.planning\n"
                  "from lightning_p2r.layout.rules import Layout, check_layout\n"
                  "check_layout(Layout(sharding='zero3'), 2)\n"
                  "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_strategy_names_resolve_after_importing_the_package_either_way() -> None:
    for code in ("import lightning_p2r, lightning as L\nfrom lightning_p2r import M6Config\n",
                 "import lightning as L, lightning_p2r\n"):
        result = _run(code + "print(type(L.Trainer(strategy='p2r_offload', accelerator='cpu', devices=1, "
                      "logger=False).strategy).__name__)")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1] == "P2RStrategy"


def test_importing_the_model_code_registers_the_strategy_names() -> None:
    result = _run("import lightning_p2r\nfrom lightning_p2r.module import M6LanguageModel\nimport lightning as L\n"
                  "trainer = L.Trainer(strategy='p2r', accelerator='cpu', devices=1, logger=False)\n"
                  "print(type(trainer.strategy).__name__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "P2RStrategy"
