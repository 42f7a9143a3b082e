"""Warnings that every run would print and that ask nothing of the user: filtered by message, nothing broader.

Each entry says why it is noise here. Warnings about a user's own choices (a checkpoint directory that is not empty,
a limit given as 1.0) are left alone.
"""

from __future__ import annotations

import warnings

_NOISE = (
    # Lightning's own pytree helper uses an API torch deprecated; nothing a user changes removes it.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
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
