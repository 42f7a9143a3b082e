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


def _import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports, read from the source: imports inside functions count (they run when
    called), imports under ``if TYPE_CHECKING:`` do not (they never run)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "lightning_p2r"

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(path): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(child) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for child in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {c for c in candidates if c in modules and c != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circle_between_the_packages_files() -> None:
    """Issue 39: no two files import each other, directly or around a circle, counting imports inside functions."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_at_most_six_modules_lie_loose_at_the_top_level() -> None:
    """Each part of the package is a folder (data/, cli/, console/, models/, strategy/, ...): only the package's
    __init__ and the model-side modules a user imports by name stay at the top."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "lightning_p2r"
    loose = sorted(path.name for path in root.glob("*.py"))
    assert len(loose) <= 6, loose


MODEL_NEUTRAL = {"lightning_p2r.models.module_init"}
"""What the strategy may import from ``models/``: the generic initialization rules, no model class."""


def test_the_strategy_imports_no_model_of_the_package() -> None:
    """Issue 39 item 2: models declare their plans; nothing under strategy/ imports M6 (or any model) to place it."""
    graph = _import_graph()
    reached = {(name, target) for name, targets in graph.items() if name.startswith("lightning_p2r.strategy")
               for target in targets if target.startswith("lightning_p2r.models")}
    assert {target for _, target in reached} <= MODEL_NEUTRAL, sorted(reached)


def test_no_name_of_the_packages_model_under_the_strategy() -> None:
    """Issue 39: the strategy speaks of declared blocks, plans and experts, not of M6 (the paper, M6-10T, aside)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "lightning_p2r" / "strategy"
    pattern = re.compile(r"\bM6(?!-10T)|M6Config|MoEFeedForward|M6Transformer")
    found = [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == []
