"""Trainer options Lightning accepts but cannot run as given, judged before anything is built (the CLI refuses
them in one line; cases through the console are in test_bad_inputs.py)."""

import pytest

from lightning_p2r.cli.trainer_options import trainer_option_problem

RUNNABLE = {"accumulate_grad_batches": 4, "val_check_interval": 0.25, "check_val_every_n_epoch": None,
            "gradient_clip_val": 1.0}


@pytest.mark.parametrize("options", [
    {}, RUNNABLE, RUNNABLE | {"val_check_interval": 100, "check_val_every_n_epoch": 2},
    RUNNABLE | {"gradient_clip_val": 0, "val_check_interval": None, "accumulate_grad_batches": None},
])
def test_runnable_options_pass(options: dict) -> None:
    assert trainer_option_problem(options) is None


@pytest.mark.parametrize(("option", "value", "message"), [
    ("accumulate_grad_batches", 0, "must be an integer >= 1"),
    ("accumulate_grad_batches", -2, "must be an integer >= 1"),
    ("accumulate_grad_batches", 2.5, "must be an integer >= 1"),
    ("accumulate_grad_batches", True, "must be an integer >= 1"),
    ("val_check_interval", 0, "must be > 0"),
    ("val_check_interval", -0.5, "must be > 0"),
    ("check_val_every_n_epoch", 0, "must be an integer >= 1 or null"),
    ("gradient_clip_val", -1.0, "must be >= 0"),
])
def test_each_unrunnable_option_is_named_with_its_value(option: str, value: object, message: str) -> None:
    problem = trainer_option_problem(RUNNABLE | {option: value})
    assert problem is not None and problem.startswith(f"--trainer.{option} {message}")
    assert f"got {value!r}" in problem and "\n" not in problem
