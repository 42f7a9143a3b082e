"""The command as a newcomer meets it (issue 27): every command listed in ``--help`` with its own ``--help``, an
unknown command with a suggestion, and recipe file errors that name the file and line."""

import re
from pathlib import Path

import pytest

from lightning_p2r.cli import COMMANDS, main
from lightning_p2r.cli.recipe_files import check_recipe_files, keys_named_in, locate_key, recipe_paths

ROOT = Path(__file__).resolve().parents[2]


def _exit_and_output(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        main(args)
    captured = capsys.readouterr()
    return stop.value.code or 0, captured.out + captured.err


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    text = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "generate", "plan", "calibrate", "convert-checkpoint"):
        assert f"\n  {name} " in text
    assert set(COMMANDS) <= {line.split()[0] for line in text.splitlines() if line.startswith("  ")}


def test_the_docs_the_top_level_help_names_exist(capsys: pytest.CaptureFixture[str]) -> None:
    """It named docs/recipes.md, a file that does not exist (a new-user audit)."""
    main(["--help"])
    named = re.findall(r"docs/[\w/.-]+\.md", capsys.readouterr().out)
    assert "docs/quickstart.md" in named
    assert [name for name in named if not (ROOT / name).is_file()] == []


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_has_its_own_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _exit_and_output(capsys, [command, "--help"])
    assert code == 0
    # The usage line names the command as users type it, whatever started the process (`python -m
    # lightning_p2r.cli` once printed "usage: __main__.py [options] fit").
    usage = text.split("\n", 1)[0]
    assert usage.startswith("usage: lightning-p2r ") and command in usage, usage
    if command not in ("fit", "validate", "test", "predict"):  # LightningCLI's help quotes every class's docstring
        assert "``" not in text.split("options:")[0]  # the module docstrings' reST markup stays out of the usage line


def test_the_quickstart_command_table_lists_every_command() -> None:
    table = (Path(__file__).parents[2] / "docs" / "quickstart.md").read_text(encoding="utf-8").split("## Commands")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([a-z-]+)`", row.split("|")[1])}
    assert set(COMMANDS) <= listed, sorted(set(COMMANDS) - listed)


def test_no_command_prints_the_commands_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _exit_and_output(capsys, [])
    assert code == 2 and "convert-checkpoint" in text


def test_an_unknown_command_is_named_with_the_closest_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _exit_and_output(capsys, ["generat"])
    assert code == 2
    assert "unknown command 'generat' (did you mean 'generate'?)" in text


def test_a_yaml_syntax_error_names_the_recipe_file_and_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("trainer:\n  max_steps: 3\n  devices: [1\nmodel:\n  config: {}\n")
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe)])
    assert code == 2
    assert f"error: recipe {recipe}: line 4, column 6:" in text
    assert "<unicode string>" not in text


def test_an_unknown_key_in_a_recipe_names_the_file_and_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("trainer:\n  max_steps: 3\nmodel:\n  config:\n    num_layerz: 2\n")
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe)])
    assert code == 2
    assert "model.config.num_layerz' (did you mean 'model.config.num_layers'?)" in text
    assert f"(in {recipe}, line 5)" in text


@pytest.mark.parametrize(("typed", "meant"), [("trainer.max_step", "trainer.max_steps"),
                                              ("trainr.max_steps", "trainer.max_steps"),
                                              ("model.optimizer.learning_rate", "model.optimizer.lr"),
                                              ("data.batchsize", "data.batch_size")])
def test_a_misspelled_recipe_key_gets_the_closest_one(typed: str, meant: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Only the command line's options got a suggestion; a recipe's key now does too, within its own section
    (learning_rate once read as min_lr_ratio, a name of the same section spelled with more of its letters)."""
    section, _, name = typed.rpartition(".")
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(section.split(".")))
                      + f"{'  ' * (section.count('.') + 1)}{name}: 3\n")
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe)])
    assert code == 2 and f"'{typed}' (did you mean '{meant}'?)" in text, text


@pytest.mark.slow
def test_a_bad_strategy_value_in_a_recipe_names_the_line_but_not_when_the_command_line_gave_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "strategy.yaml"
    recipe.write_text("trainer:\n  strategy:\n    class_path: lightning_p2r.P2RStrategy\n    init_args:\n"
                      "      sharding: zero3\n")
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe), "--trainer.strategy.sharding=zero5"])
    assert code == 2 and "zero5" in text and "(in " not in text  # the override's value, not the recipe's line
    assert "fit [--config" in text and "run: lightning-p2r fit --help" in text, text
    # Refused by the strategy when made, after parsing, through the parser above fit's: still fit's usage and fit's
    # --help (its tip said `lightning-p2r --help`, which lists the commands, not the options).
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe),
                                           "--trainer.strategy.device_memory_budget=0.5"])
    assert code == 2 and "device_memory_budget=0.5 is bytes" in text, text
    assert "usage: lightning-p2r fit [--config" in text and "run: lightning-p2r fit --help" in text, text
    recipe.write_text(recipe.read_text().replace("zero3", "zero4"))
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe)])
    assert code == 2 and "zero4" in text and f"(in {recipe}, line 5)" in text
    # A value the parser prints otherwise than it was typed (YAML's true is printed True) is still the override's.
    recipe.write_text("data:\n  batch_size: 16\n")
    code, text = _exit_and_output(capsys, ["fit", "--config", str(recipe), "--data.batch_size=true"])
    assert code == 2 and "batch_size" in text and "(in " not in text


def test_recipe_paths_and_problems(tmp_path: Path) -> None:
    assert recipe_paths(["fit", "--config", "a.yaml", "-c", "b.yaml", "--config=c.yaml"]) == ["a.yaml", "b.yaml",
                                                                                              "c.yaml"]
    assert "does not exist" in check_recipe_files([str(tmp_path / "missing.yaml")])
    assert "is a folder" in check_recipe_files([str(tmp_path)])
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert "got a list at the top level" in check_recipe_files([str(listed)])
    assert check_recipe_files(["{trainer: {max_steps: 2}}"]) is None  # inline YAML is the parser's
    assert check_recipe_files([str(p) for p in sorted((ROOT / "recipes").glob("*.yaml"))]) is None


def test_a_key_is_found_through_init_args_in_the_last_recipe_that_sets_it(tmp_path: Path) -> None:
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("trainer:\n  strategy:\n    class_path: x.Y\n    init_args:\n      sharding: zero3\n")
    second.write_text("trainer:\n  max_steps: 2\n")
    assert locate_key([str(first), str(second)], "trainer.strategy.sharding") == f"{first}, line 5"
    assert locate_key([str(first), str(second)], "trainer.max_steps") == f"{second}, line 2"
    assert locate_key([str(first)], "model.config") is None
    assert keys_named_in("trainer.strategy: option 'shardin' is not accepted")[0] == "trainer.strategy.shardin"


def test_a_command_builds_the_parser_of_its_own_subcommand_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of Lightning's subcommand parsers reads the signatures and docstrings of every class it takes (about
    0.4 s on 2 cores): ``lightning-p2r validate ...`` builds validate's, not fit's, test's and predict's too. A
    P2RCLI built without a subcommand (``run=False``) keeps Lightning's list."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_p2r.cli.fit import P2RCLI

    built: list[str] = []
    real = LightningCLI._prepare_subcommand_parser

    def recording(self, klass, subcommand, **kwargs):
        built.append(subcommand)
        return real(self, klass, subcommand, **kwargs)

    monkeypatch.setattr(LightningCLI, "_prepare_subcommand_parser", recording)
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert built == ["validate"]
    cli = P2RCLI.__new__(P2RCLI)
    cli._command_line = ["--config", "recipe.yaml"]
    assert set(cli.subcommands()) == set(LightningCLI.subcommands())


def test_a_callbacks_own_refusal_is_the_line_the_cli_prints() -> None:
    """jsonargparse lists each subtype's error for a list of callbacks; the line kept was the last ("Expected a
    <class 'NoneType'>"), which hid PseudoToReal's own sentence (a new-user audit)."""
    from lightning_p2r.cli.fit import condense

    raw = """Does not validate against any of the Union subtypes
Subtypes: [list[lightning.pytorch.callbacks.callback.Callback], <class 'NoneType'>]
Errors:
  - PseudoToReal.delink_at_fraction must be in [0, 1), got 1.5
  - Not a valid subclass of Callback
    Subclass types expect one of:
    - a class path (str)
    - a dict with class_path entry
  - Expected a <class 'NoneType'>
Given value type: <class 'list'>
Given value: [Namespace(class_path='lightning_p2r.PseudoToReal')]"""
    assert condense(raw) == "PseudoToReal.delink_at_fraction must be in [0, 1), got 1.5"
    optional = """Parser key "offload_fraction":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'float'>, <class 'NoneType'>]
  Errors:
    - Expected a <class 'float'>
    - Expected a <class 'NoneType'>
  Given value type: <class 'str'>
  Given value: half"""
    assert condense(optional) == "offload_fraction: expected a number or null, got 'half'"


def test_every_command_taking_a_recipe_takes_it_as_fit_does() -> None:
    """`fit -c RECIPE` works (LightningCLI's short flag), and `generate -c RECIPE ...` said `the following arguments
    are required: --config` to a user who had just given it."""
    from lightning_p2r.cli.generate import build_parser as generate
    from lightning_p2r.cli.lm_eval import build_parser as lm_eval
    from lightning_p2r.planning.cli import build_parser as plan

    assert generate().parse_args(["-c", "r.yaml", "--ckpt_path", "last", "--prompt", "hi"]).config == "r.yaml"
    assert lm_eval().parse_args(["-c", "r.yaml", "--ckpt_path", "last"]).config == "r.yaml"
    assert plan().parse_args(["--cluster", "c.yaml", "-c", "r.yaml"]).config == "r.yaml"


def test_lm_eval_help_says_its_whole_purpose_and_defaults() -> None:
    """Its description was the docstring's first line, which ended mid-phrase ("... on the per-language
    verse-continuation"), and its options showed no defaults."""
    from lightning_p2r.cli.lm_eval import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "verse-continuation tasks (lm_eval_adapter.bible_choice_tasks), offline, and print one table" in text
    assert "(default: en,fr,de,ru,zh)" in text and "(default: 50)" in text and "(default: 0)" in text
