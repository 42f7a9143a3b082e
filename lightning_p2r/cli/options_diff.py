"""Which options a run asks for differ from those a checkpoint was trained with (pure, no Lightning).

Resuming a checkpoint with other model options would either fail deep inside ``load_state_dict`` (a shape) or,
worse, silently train something else than asked (LightningCLI replaces the model options by the checkpoint's; a
changed dropout or learning rate would be dropped without a word). Both the CLI and the module compare first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def differing_options(requested: Mapping[str, Any], saved: Mapping[str, Any], prefix: str = "") -> list[
        tuple[str, Any, Any]]:
    """``(dotted name, requested value, saved value)`` for every option present in both that differs.

    Options only one side has are not compared: a checkpoint written before an option existed resumes with its
    default. Lists and tuples compare as equal when their items are (YAML gives lists, dataclasses tuples).
    """
    differences = []
    for key in requested.keys() & saved.keys():
        name = f"{prefix}{key}"
        mine, theirs = requested[key], saved[key]
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            differences += differing_options(mine, theirs, prefix=f"{name}.")
        elif _normalized(mine) != _normalized(theirs):
            differences.append((name, mine, theirs))
    return sorted(differences)


def _normalized(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalized(item) for item in value]
    return value


def describe_differences(differences: list[tuple[str, Any, Any]], prefix: str = "model.") -> str:
    """One clause per option: ``model.config.num_layers=8 (the checkpoint has 4)``."""
    return ", ".join(f"{prefix}{name}={mine!r} (the checkpoint has {theirs!r})" for name, mine, theirs in differences)
