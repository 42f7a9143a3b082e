"""The docs that promise things: the README's commands, the generated configuration reference."""

import re
from pathlib import Path

from lightning_p2r.cli import docs as docs_gen

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    quickstart = ROOT.joinpath("README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quickstart, flags=re.S)]


def test_readme_quickstart_has_exactly_two_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    assert "lightning-p2r fit --config recipes/quickstart.yaml" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    assert _readme_commands()[1] in ROOT.joinpath(".ci/run").read_text()


def test_the_readme_test_command_runs_every_test() -> None:
    """The README's command is the whole suite on two workers (issue 39: at most 10 minutes on 2 cores): no marker
    or keyword leaves a test to a second command."""
    command = _readme_commands()[1]
    assert command.endswith("python -m pytest -q -n 2"), command
    assert " -m " not in command.split("pytest", 1)[1] and " -k " not in command


def test_configuration_reference_is_up_to_date() -> None:
    assert docs_gen.main(["--check"]) == 0, "run: python -m lightning_p2r.cli.docs"


def test_every_config_field_is_documented() -> None:
    from lightning_p2r import M6Config, OptimizerConfig
    from lightning_p2r.strategy.options import SECTIONS

    for cls in (M6Config, OptimizerConfig, *SECTIONS.values()):
        docs = docs_gen.field_docstrings(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_test_file_names_are_unique_across_tiers() -> None:
    # The tiers have no __init__.py, so pytest imports each test file by its base name: two files of one name in
    # different tiers make the whole README test command fail at collection, though each tier alone passes.
    names = [path.name for path in ROOT.joinpath("tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []
