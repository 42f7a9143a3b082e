"""The ``lightning-p2r`` command line: one dispatch table, one module per command.

- ``fit`` (also ``validate``, ``test``, ``predict``): :mod:`.fit`, a LightningCLI over a recipe;
- ``prepare-data``: :mod:`.prepare`; ``generate``: :mod:`.generate`; ``lm-eval``: :mod:`.lm_eval`;
- ``convert-checkpoint``: :mod:`.fit` (sharded to one file); ``convert``: :mod:`lightning_p2r.cli.convert`;
- ``plan`` and ``calibrate``: the planner's own (:mod:`lightning_p2r.planning.cli`, :mod:`lightning_p2r.measure.
  calibrate`), kept beside what they drive;
- ``python -m lightning_p2r.cli.docs``: regenerates docs/configuration.md.

A command's module is imported only when it runs, so ``lightning-p2r --help`` and a mistyped command answer
without loading torch.
"""

from __future__ import annotations

import difflib
import sys
from importlib import import_module
from typing import Any

# Every command, with its one line in ``lightning-p2r --help``. The first four are LightningCLI's (a recipe and its
# overrides); the others have their own argparse parsers, loaded only when called.
COMMANDS: dict[str, str] = {
    "fit": "train a model from a recipe (lightning-p2r fit --config recipes/quickstart.yaml)",
    "validate": "one pass over the validation data with a recipe and --ckpt_path",
    "test": "one pass over the test data with a recipe and --ckpt_path",
    "predict": "next-token predictions over the predict data with a recipe and --ckpt_path",
    "generate": "sample text from a checkpoint (single-file or sharded) with a recipe's tokenizer",
    "prepare-data": "tokenize a corpus once into streamed chunks a recipe trains from (data.prepared)",
    "plan": "price parallel layouts of a recipe's model on a cluster and rank them",
    "calibrate": "measure this machine's compute, memory and collective speeds for the planner",
    "convert-checkpoint": "write a sharded checkpoint as one file any strategy loads",
    "convert": "write a checkpoint as a Hugging Face directory (--to hf), safetensors (--to safetensors) "
                "or one checkpoint file (--to checkpoint)",
    "lm-eval": "score a checkpoint with lm-evaluation-harness on per-language verse continuations (offline)",
}
_LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

# Where each other command's ``main(argv)`` lives.
_RUNNERS = {
    "convert-checkpoint": "lightning_p2r.cli.convert:convert_checkpoint",
    "plan": "lightning_p2r.planning.cli:main",
    "calibrate": "lightning_p2r.measure.calibrate:main",
    "generate": "lightning_p2r.cli.generate:main",
    "lm-eval": "lightning_p2r.cli.lm_eval:main",
    "convert": "lightning_p2r.cli.convert:main",
    "prepare-data": "lightning_p2r.cli.prepare:main",
}


def top_level_help() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = [f"  {name:<{width}}{text}" for name, text in COMMANDS.items()]
    return ("usage: lightning-p2r COMMAND [options]\n\nTrain, evaluate and sample M6 mixture-of-experts language "
            "models with P2RStrategy.\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`lightning-p2r COMMAND --help` lists a command's options. Docs: docs/quickstart.md (commands, "
            "recipes, runs), docs/configuration.md (every recipe option).\n")


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-p2r COMMAND`` (see ``COMMANDS``). Returns nothing: the console script passes the
    return value to ``sys.exit``, which would turn an object into exit status 1."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(top_level_help())
        if not argv:
            raise SystemExit(2)
        return
    command = argv[0]
    if not command.startswith("-") and command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        sys.stderr.write(f"usage: lightning-p2r COMMAND [options]\nerror: unknown command {command!r}{hint}; the "
                         f"commands are {', '.join(COMMANDS)} (lightning-p2r --help)\n")
        raise SystemExit(2)
    if command in _RUNNERS:
        module, function = _RUNNERS[command].split(":")
        getattr(import_module(module), function)(argv[1:])
        return
    from .fit import run_lightning_command

    run_lightning_command(argv, args)


def __getattr__(name: str) -> Any:
    """``lightning_p2r.cli.P2RCLI`` and the fit command's other names, as before the commands got modules."""
    if name.startswith("__"):
        raise AttributeError(name)
    fit = import_module(f"{__name__}.fit")
    if hasattr(fit, name):
        return getattr(fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
