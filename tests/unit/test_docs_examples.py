"""The Python examples in README.md and docs/: each parses, each name it imports from the package exists, and the
complete ones (a model, data and a Trainer) train as written, shortened to a few steps. A renamed function or
argument would otherwise leave the docs teaching code that fails."""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[:match.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", textwrap.dedent(match.group(1))))
    return found


EXAMPLES = _examples()


def _package_imports(code: str) -> list[tuple[str, str]]:
    return [(node.module, alias.name) for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_p2r")
            for alias in node.names]


@pytest.mark.parametrize("where,code", EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_each_example_parses_and_imports_what_exists(where: str, code: str) -> None:
    for module_name, name in _package_imports(code):
        module = importlib.import_module(module_name)
        if not hasattr(module, name):  # ``from package import submodule``
            importlib.import_module(f"{module_name}.{name}")


def _example(page: str, starts_with: str) -> str:
    matches = [code for where, code in EXAMPLES if where.startswith(page) and starts_with in code]
    assert len(matches) == 1, (page, starts_with, len(matches))
    return matches[0]


SHORT = ("max_steps=2, limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, "
         "enable_model_summary=False, default_root_dir=ROOT_DIR")


@pytest.mark.slow
@pytest.mark.parametrize("page,marker,trainer_call", [
    ("README.md", "num_unique_blocks=1, num_experts=8", "L.Trainer(max_steps=1000)"),
    ("docs/your_model.md", '"model_type": "qwen3_moe"', "L.Trainer(max_steps=200, "),
])
def test_the_complete_examples_train_as_written(page: str, marker: str, trainer_call: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    code = _example(page, marker)
    assert trainer_call in code, "the example's Trainer call changed: update the test's shortening"
    shortened = code.replace(trainer_call, trainer_call.replace("max_steps=1000)", f"{SHORT})")
                             .replace("max_steps=200, ", f"{SHORT}, "))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"ROOT_DIR": str(tmp_path)}
    exec(compile(shortened, page, "exec"), namespace)  # noqa: S102 - the docs' own example, shortened
    trainers = [value for value in namespace.values() if type(value).__name__ == "Trainer"]
    module = next(value for name, value in namespace.items() if name in ("model", "module"))
    assert module.trainer is not None and module.trainer.global_step == 2, trainers
