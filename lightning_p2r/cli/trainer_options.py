"""Trainer options Lightning accepts but cannot run, refused by the CLI before anything is built.

Lightning 2.6 takes each of these and fails later (or not at all): ``accumulate_grad_batches=0``,
``val_check_interval=0`` and ``check_val_every_n_epoch=0`` end the first training batch in a ``ZeroDivisionError``
("integer modulo by zero"), after the data was prepared and the model built; a negative ``accumulate_grad_batches``
or ``gradient_clip_val`` trains as if the option were 1 or unset, so the run a user asked for silently is not the
one that runs.
"""

from __future__ import annotations

from typing import Any


def trainer_option_problem(trainer: Any) -> str | None:
    """The first of ``trainer``'s options that cannot run as given, as a one-line message naming the option, its
    value and what it accepts; None when every one can. ``trainer``: the parsed ``trainer:`` section (a dict, or the
    parser's namespace), read with ``.get``."""
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not _is_integer(accumulate) or accumulate < 1):
        return ("--trainer.accumulate_grad_batches must be an integer >= 1 (batches per optimizer step), got "
                f"{accumulate!r}")
    interval = trainer.get("val_check_interval")
    if _is_number(interval) and interval <= 0:
        return ("--trainer.val_check_interval must be > 0 (a fraction of the epoch in (0, 1], or a number of "
                f"batches), got {interval!r}; to skip validation set --trainer.limit_val_batches=0")
    epochs = trainer.get("check_val_every_n_epoch")
    if epochs is not None and (not _is_integer(epochs) or epochs < 1):
        return (f"--trainer.check_val_every_n_epoch must be an integer >= 1 or null (validate by "
                f"val_check_interval only), got {epochs!r}")
    clip = trainer.get("gradient_clip_val")
    if _is_number(clip) and clip < 0:
        return (f"--trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip!r}; a negative "
                "value would train unclipped")
    return None


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
