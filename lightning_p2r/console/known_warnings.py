"""Warnings that every run would print and that ask nothing of the user: filtered by message, nothing broader.

Each entry says why it is noise here. Warnings about a user's own choices (a checkpoint directory that is not empty,
a limit given as 1.0) are left alone.
"""

from __future__ import annotations

import logging
import warnings

_NOISE = (
    # Lightning's own pytree helper uses an API torch deprecated; nothing a user changes removes it.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # Lightning warns about every IterableDataset with a length under worker processes; litdata's StreamingDataset
    # gives each worker its own share of the windows and counts them, so the length is right (prepared data).
    r"Your `IterableDataset` has `__len__` defined",
    # litdata reads a window of token ids with torch.frombuffer from a read-only buffer and clones it at once.
    r"The given buffer is not writable, and PyTorch does not support non-writable tensors",
    # The per-language metrics of a multilingual evaluation pass are summed over the ranks before they are logged
    # (M6LanguageModel._log_languages); Lightning, not knowing, asks for sync_dist once per metric and language.
    r"It is recommended to use `self.log\('(val|test)/(loss|ppl|bpb|tokens)(/[a-z]+)?', \.\.\., sync_dist=True\)`",
)

# Raised by torch's LR scheduler on its first step when the optimizer it drives is not the one it was created
# over. The package rebinds schedulers to the optimizer it builds (host/device split, ZeRO-1, delinking), and
# Lightning steps the optimizer before the scheduler, so the order the warning guards is kept.
REBOUND_SCHEDULER = r"Seems like `optimizer.step\(\)` has been overridden after learning rate scheduler initialization"


def silence_known_noise() -> None:
    for message in _NOISE:
        warnings.filterwarnings("ignore", message=message)


def silence_rebound_scheduler_notice() -> None:
    warnings.filterwarnings("ignore", message=REBOUND_SCHEDULER)


def _not_an_advert(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def silence_cli_notices() -> None:
    """For the ``lightning-p2r`` command: Lightning logs a tip to install its own cloud logger on every run whose
    loggers do not include it (the recipes choose W&B and CSV on purpose). A user's own scripts keep it."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)


def drop_unset_wandb_anonymous(logger: object) -> None:
    """Lightning's ``WandbLogger`` always hands ``anonymous`` to ``wandb.init`` (None when the user gave nothing), and
    W&B warns on every run that the setting has no effect. Unset means unset: the key is dropped when it is None
    (``_wandb_init`` is the logger's private dict of ``wandb.init`` arguments; docs/architecture.md lists it)."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous", False) is None:
        del init["anonymous"]


ALLOWED_IN_RECIPE_RUNS = (
    # The package's own notice when a job starts more CPU processes than the machine has cores (the 4-process
    # recipe on a 2-core machine): it is about the user's machine, and it is right.
    r"CPU processes on \d+ cores",
)
"""The warnings a recipe may print, each a regular expression with the reason it is not noise (tests check every
recipe's output against it: tests/distributed/test_recipes_quiet.py)."""
