"""The ``lightning-p2r`` command: a LightningCLI over :class:`M6LanguageModel` and :class:`TextDataModule`.

Where a run's files go: everything under ``trainer.default_root_dir`` (the recipes set ``runs/<recipe>``). A
logger whose ``save_dir`` is unset or ``"."`` and a ``ModelCheckpoint`` without a ``dirpath`` are pointed there
(checkpoints in ``<root>/checkpoints``), so ``--trainer.default_root_dir`` moves a whole run. ``config.yaml`` is
written to the root once the first batch has trained (the options, the data, the strategy's setup and the
checkpoint were accepted), atomically, and only by ``fit``: a call that fails, or a ``validate``/``test``/
``predict`` of the run, leaves the training run's config alone. Several fits in one root keep each other's
checkpoints (Lightning names the newer ``last-v1.ckpt``, ...); ``--ckpt_path last`` resumes from the newest.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NoReturn

import torch
from jsonargparse import Namespace, set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from .. import register_strategies
from ..callbacks.throughput import Throughput
from ..console.known_warnings import drop_unset_wandb_anonymous, silence_cli_notices
from ..data import TextDataModule
from ..data.language_eval import language_table
from ..files import write_atomically
from ..module import M6LanguageModel
from ..strategy.checkpoint import META_FILE, check_checkpoint_path
from ..strategy.launch import RankFailed
from .options_diff import describe_differences, differing_options
from .recipe_files import check_recipe_files, keys_named_in, locate_key, names_model_class, recipe_paths
from .trainer_options import trainer_option_problem

# The dataclass fields' docstrings become --help text and YAML comments.
set_parsing_settings(docstring_parse_attribute_docstrings=True)

# Loggers whose output folder is their ``save_dir`` init argument: None or "." (W&B's default; CSVLogger requires
# a value, so recipes write ".") means the root dir.
_LOGGERS_WITH_SAVE_DIR = ("WandbLogger", "CSVLogger", "TensorBoardLogger")

register_strategies()  # `strategy: p2r` in a recipe resolves through Lightning's registry


class P2RArgumentParser(LightningArgumentParser):
    """A mistyped option gets one usage line and a "did you mean" instead of the whole option list (about 90 lines
    that hid the error itself); ``--help`` still prints everything. Options are never abbreviated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefix matching: a truncated name (--model.config.num_expert) must be an error, not a silent match.
        kwargs.setdefault("allow_abbrev", False)
        # The command's own name, also under `python -m lightning_p2r.cli` (argparse would say "__main__.py").
        kwargs.setdefault("prog", "lightning-p2r")
        super().__init__(*args, **kwargs)

    def print_usage(self, file: IO[str] | None = None) -> None:
        (file or sys.stderr).write(f"usage: {self.prog} [--config RECIPE] [--section.option VALUE ...]\n")

    recipe_files: list[str] = []
    """The ``--config`` files of this command line (set by :class:`P2RCLI`), to say where a key the error names is."""
    command_line: list[str] = []
    """The command line's words: a key given there is the user's override, not the recipe's."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser = getattr(ex, "subcommand_parser", None) or self
        command = self.command_line[0] if self.command_line else ""
        if command in LightningCLI.subcommands() and command not in self.prog.split():
            # An error after parsing (a class refusing its arguments) comes from the parser above the command's:
            # its usage line and its tip ("run: lightning-p2r --help") would name no command, whose --help lists
            # the options.
            self.prog = f"{self.prog} {command}"
        condensed = condense(message)
        super().error(condensed + _suggestion(parser, message) + _strategy_option_hint(condensed)
                      + _recipe_location(self.recipe_files, self.command_line, condensed + "\n" + message), ex)


def _recipe_location(files: list[str], command_line: list[str], message: str) -> str:
    """`` (in recipes/x.yaml, line 5)`` when a key the message names was set by a recipe file and not overridden on
    the command line."""
    given = dict(_overrides(command_line))
    got = re.search(r"Got value: (\S+)", message)
    for key in keys_named_in(message):
        # jsonargparse checks a recipe's values as it loads the file, before later overrides: a key given on the
        # command line is the override's only when the refused value is the override's.
        if key in given and (got is None or _same_value(given[key], got.group(1))):
            return ""
        where = locate_key(files, key)
        if where:
            return f" (in {where})"
    return ""


def _same_value(typed: str, printed: str) -> bool:
    """Whether the command line's ``typed`` value is the one jsonargparse ``printed`` as refused: as typed, or as
    YAML reads it (``true`` is printed ``True``)."""
    if typed == printed:
        return True
    import yaml

    try:
        return str(yaml.safe_load(typed)) == printed
    except yaml.YAMLError:
        return False


_TYPE_WORDS = {"float": "a number", "int": "an integer", "str": "a string", "bool": "true or false",
               "NoneType": "null"}
"""How a recipe writes a value of each type jsonargparse names."""


def _expected_one_of(expected: list[re.Match[str]], given: str) -> str:
    """``expected a number or null, got 'half'``, or for a union of literals (``trainer.precision``) their values,
    with the nearest one: ``expected one of 64, 32, ..., 'bf16-mixed', ... or null, got 'bf17-mixed' (did you mean
    'bf16-mixed'?)`` (jsonargparse named only the last type it tried: "Expected a <class 'NoneType'>")."""
    import ast

    words, values = [], []
    for match in expected:
        if match.group(1) is not None:
            words.append(_TYPE_WORDS.get(match.group(1), match.group(1)))
        else:
            values += ast.literal_eval(f"[{match.group(2)}]")
    if not values:
        return f"expected {' or '.join(words)}, got {given!r}"
    close = difflib.get_close_matches(given, [str(v) for v in values], n=1)
    listed = ", ".join(repr(v) for v in dict.fromkeys(values))
    return (f"expected one of {listed}{' or ' + ' or '.join(words) if words else ''}, got {given!r}"
            + (f" (did you mean {close[0]!r}?)" if close else ""))


def condense(message: str) -> str:
    """jsonargparse reports a bad value inside a class given by path (``--trainer.strategy.sharding=zero4``) as a
    dozen lines of union subtypes; keep the one that matters: ``trainer.strategy.sharding: expected one of [...]``."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) < 2:
        return message
    names = list(dict.fromkeys(re.findall(r'Parser key "([^"]+)"', message)))
    problems = [i for i, line in enumerate(lines) if line.startswith("- Problem with given class_path")]
    if problems and problems[-1] + 1 < len(lines):
        # The class's own parser already condensed its error ("sharding: expected ..."): prefix the outer key.
        inner = lines[problems[-1] + 1]
        unknown = re.fullmatch(r"Option '([^']+)' is not accepted", inner)
        if unknown and names:  # not "trainer.strategy.Option 'x' ..."
            return f"{names[0]}: option {unknown.group(1)!r} is not accepted"
        return f"{names[0]}.{inner}" if names else inner
    if "Union subtypes" in message:
        # A value none of an optional option's types takes ("offload_fraction: half"): every type it could have been,
        # not only the last one tried ("Expected a <class 'NoneType'>").
        expected = [re.fullmatch(r"- Expected a (?:<class '(\w+)'>|typing\.Literal\[(.*)\])", line)
                    for line in lines if line.startswith("- ")]
        given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), None)
        if expected and all(expected) and given is not None:
            detail = _expected_one_of(expected, given)  # type: ignore[arg-type]
            return f"{names[0]}: {detail}" if names else detail
        # The reason the class itself gave (its constructor's ValueError), not "expected a str".
        reasons = [line[2:] for line in lines if line.startswith("- ")
                   and not line.startswith(("- Expected a <class 'str'>", "- Problem with given class_path"))]
        # Of the subtypes' errors, the class's own sentence (a callback's ValueError among a list of callbacks),
        # not that the value is no None or no subclass of the other subtypes.
        own = [reason for reason in reasons if not reason.startswith(("Expected a ", "Not a valid subclass", "a "))]
        if reasons:
            reason = (own or reasons)[-1]
            return f"{names[0]}: {reason}" if names else reason
    keyed = [i for i, line in enumerate(lines) if line.startswith("Parser key")]
    if not keyed:
        return message
    last = lines[keyed[-1]]
    detail = last.split(":", 1)[1].strip() if not last.endswith(":") else (
        lines[keyed[-1] + 1] if keyed[-1] + 1 < len(lines) else "")
    detail = detail.replace("Expected a typing.Literal[", "expected one of [").replace("Expected a", "expected a")
    return f"{'.'.join(names)}: {detail}"


def _overrides(command_line: list[str]) -> list[tuple[str, str | None]]:
    """``(key, value)`` for each ``--section.key=value`` or ``--section.key value`` (``init_args`` levels dropped)."""
    pairs = []
    for index, word in enumerate(command_line):
        if word.startswith("--") and word not in ("--config", "--ckpt_path"):
            name, _, value = word[2:].partition("=")
            if not value and index + 1 < len(command_line) and not command_line[index + 1].startswith("-"):
                value = command_line[index + 1]
            pairs.append((name.replace(".init_args.", "."), value or None))
    return pairs


def _suggestion(parser: LightningArgumentParser, message: str) -> str:
    """`` (did you mean: --trainer.max_stpes -> --trainer.max_steps?)`` for an unrecognized option (`` (did you mean
    'trainer.max_steps'?)`` for a recipe's key): an option of
    that name in another section (``--lr`` or ``--model.lr`` -> ``--model.optimizer.lr``; ``--strategy.sharding`` ->
    ``--trainer.strategy.sharding``, the strategy's options being P2RStrategy's keywords), else the closest
    spelling."""
    known = [option for action in parser._actions for option in action.option_strings]  # noqa: SLF001
    # A recipe's key ("Subcommand 'fit' does not accept option 'trainer.max_step'"): named as it is written there.
    recipe_key = re.search(r"does not accept option '([^']+)'", message)
    if recipe_key:
        close = _meant(f"--{recipe_key.group(1)}", known)
        return f" (did you mean '{close[0][2:]}'?)" if close else ""
    if "unrecognized arguments" not in message:
        return ""
    hints = []
    for word in message.split(":", 1)[-1].split():
        if word.startswith("--"):
            typed = word.split("=", 1)[0]
            close = _meant(typed, known)
            hints += [f"{typed} -> {close[0]}"] if close else []
    return f" (did you mean: {', '.join(hints)}?)" if hints else ""


SPELLED_ELSEWHERE = {"learning_rate": "lr", "batchsize": "batch_size", "epochs": "max_epochs"}
"""Names other libraries give an option, and this package's (the spelling alone does not lead there)."""


def _meant(typed: str, known: list[str]) -> list[str]:
    """The option a mistyped ``typed`` most likely means: the same name in another section, else the closest
    spelling (one at most)."""
    return _same_name_elsewhere(typed, known) or _closest_spelling(typed, known)


def _closest_spelling(typed: str, known: list[str]) -> list[str]:
    """The known option spelled most like ``typed``: among its own section's options by the last name (so that a
    shared long prefix does not make ``model.optimizer.learning_rate`` look like ``model.optimizer.min_lr_ratio``),
    else, for a mistyped section (``trainr.accelerator``), over the whole name."""
    section, _, name = typed.rpartition(".")
    siblings = {option.rpartition(".")[2]: option for option in known if option.rpartition(".")[0] == section}
    if siblings:
        name = SPELLED_ELSEWHERE.get(name, name)
        close = [name] if name in siblings else difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.75)
        return [siblings[close[0]]] if close else []
    return difflib.get_close_matches(typed, known, n=1, cutoff=0.75)


def _same_name_elsewhere(typed: str, known: list[str]) -> list[str]:
    """The known options (P2RStrategy's keywords as ``--trainer.strategy.*`` among them) whose last name is
    ``typed``'s, the one sharing most of ``typed``'s sections first; none when the name is ambiguous across several
    sections that ``typed`` does not tell apart."""
    from ..strategy import P2RStrategy

    strategy = [f"--trainer.strategy.{name}" for name in inspect.signature(P2RStrategy.__init__).parameters
                if name != "self"]
    sections = typed[2:].split(".")
    same = [option for option in dict.fromkeys([*known, *strategy])
            if option != typed and option[2:].split(".")[-1] == sections[-1]]
    shared = {option: len(set(option[2:].split(".")[:-1]) & set(sections[:-1])) for option in same}
    best = max(shared.values(), default=0)
    ranked = [option for option in same if shared[option] == best]
    return ranked if len(ranked) == 1 else []


def _strategy_option_hint(message: str) -> str:
    """`` (did you mean 'sharding'?)`` for a mistyped ``P2RStrategy`` option (jsonargparse only says it is not
    accepted), and what to add when a recipe without a strategy class gets strategy options."""
    if re.search(r"strategy: Expected a dot import path string", message):
        # An init_args override on a recipe that names no strategy class (Lightning's "auto").
        return (" (the recipe names no strategy class: pass --trainer.strategy=lightning_p2r.P2RStrategy before "
                "--trainer.strategy.init_args.*)")
    match = re.search(r"strategy: option '([^']+)' is not accepted", message)
    if match is None:
        return ""
    from ..strategy import P2RStrategy

    known = [name for name in inspect.signature(P2RStrategy.__init__).parameters if name != "self"]
    close = difflib.get_close_matches(match.group(1), known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _BatchesRun(Callback):
    """Whether this command has started a batch of its own (training, or the evaluation ``validate``, ``test`` and
    ``predict`` run; not the sanity check): a refusal before that is the user's input."""

    started = False

    def on_train_batch_start(self, *args: Any) -> None:
        self.started = True

    def on_validation_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.started = self.started or not trainer.sanity_checking

    def on_test_batch_start(self, *args: Any) -> None:
        self.started = True

    def on_predict_batch_start(self, *args: Any) -> None:
        self.started = True


class SaveConfigWhenTraining(SaveConfigCallback):
    """Writes ``config.yaml`` into ``trainer.default_root_dir`` once ``fit`` has trained its first batch,
    atomically (a temporary file renamed over the old one). Lightning's callback writes at ``setup``, before the
    strategy, the checkpoint and the first batch were accepted, and for every subcommand: a failing call or an
    evaluation would replace the config of the run whose checkpoints sit beside it."""

    filled: list[tuple[Namespace, str, Any]] = []
    """The output options the CLI filled from ``default_root_dir`` (:func:`place_outputs_under_root`; set on the
    instance by :class:`P2RCLI` once the trainer holds it)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pass  # deferred to the end of the first training batch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.already_saved:
            return
        if trainer.is_global_zero:
            root = str(trainer.default_root_dir)
            with as_given(self.filled):  # the output folders as the recipe gave them (from default_root_dir)
                text = self.parser.dump(self.config, skip_none=False)
            write_atomically(os.path.join(root, self.config_filename), text)
            self.save_config(trainer, pl_module, "fit")
        self.already_saved = True


class P2RCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary size linked into the model config, outputs under the root
    dir, and model options checked against the checkpoint's before a resume."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = kwargs.get("args")
        self._command_line = [str(a) for a in arguments] if isinstance(arguments, list) else sys.argv[1:]
        self._recipe_files = recipe_paths(self._command_line)
        self._filled_outputs: list[tuple[Namespace, str, Any]] = []  # what place_outputs_under_root filled
        kwargs.setdefault("parser_class", P2RArgumentParser)
        kwargs.setdefault("save_config_callback", SaveConfigWhenTraining)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  (Lightning's is static)
        """Lightning's subcommands, or only the one the command line names: each subcommand's parser reads the
        signatures and docstrings of every class it takes (about 0.4 s on 2 cores), and a command runs one."""
        every = LightningCLI.subcommands()
        named = self._command_line[0] if self._command_line else None
        return {named: every[named]} if named in every else every

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        parser.recipe_files, parser.command_line = self._recipe_files, self._command_line
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Every run logs its tokens/s, TFLOP/s per device and MFU (--throughput.window, --throughput.peak_tflops).
        parser.add_lightning_class_args(Throughput, "throughput")
        # The embedding must cover every id the tokenizer emits; linking removes the chance to set them apart.
        if self.subclass_mode_model:  # a model class the recipe picks (CausalLMModule takes vocab_size)
            parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
            return
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.config.max_seq_len", apply_on="parse")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI next replaces the model options by a checkpoint's hyperparameters (--ckpt_path): keep what
        # the user asked for, to compare.
        section = self.config.get(self.config.get("subcommand") or "", self.config)
        self._requested_model = copy.deepcopy(_as_dict(section.get("model")))
        # Before LightningCLI reads the checkpoint's hyperparameters (an empty or corrupt file would fail there
        # with a bare EOFError or a weights-only lecture).
        ckpt_path = section.get("ckpt_path")
        if ckpt_path:
            try:
                p2r = _is_p2r_strategy(section.trainer.get("strategy"))
                # P2RStrategy reads the bytes against their checksums as it resumes, the ranks sharing the reading;
                # under another strategy this is the only check (in each process the launcher starts).
                check_checkpoint_path(ckpt_path, loads_sharded=p2r, integrity=not p2r)
            except ValueError as error:
                self.parser.error(f"--ckpt_path: {error}")

    def before_instantiate_classes(self) -> None:
        section = self.config[self.config.subcommand] if self.config.get("subcommand") else self.config
        problem = trainer_option_problem(section.trainer)
        if problem:
            self.parser.error(problem)
        section.trainer.strategy = strategy_from_class_path(section.trainer.get("strategy"))
        problem = unknown_strategy_problem(section.trainer.strategy, StrategyRegistry.available_strategies())
        if problem:
            self.parser.error(problem)
        self._filled_outputs = place_outputs_under_root(section.trainer)
        problem = missing_last_problem(self.config.get("subcommand") or "", section.get("ckpt_path"),
                                       checkpoint_folders(section.trainer))
        if problem:
            self.parser.error(problem)
        resumed = _as_dict(section.get("model"))  # a checkpoint file's options, merged in by LightningCLI
        if section.get("ckpt_path") == "last":
            # Lightning resolves "last" only once fit starts, after the model was built: compare with it now.
            resumed = newest_last_hyperparameters(section.trainer) or resumed
        self._refuse_dropped_overrides(resumed)

    def after_instantiate_classes(self) -> None:
        for callback in getattr(self.trainer, "callbacks", []):
            if isinstance(callback, SaveConfigWhenTraining):
                callback.filled = self._filled_outputs
        # Before W&B starts (at the first log): its service writes debug logs under $WANDB_DIR (default: the
        # working directory), and it warns "git root ... does not exist" when its folder is not there yet. Done only
        # now that every option was accepted, so a refused call leaves no folder behind.
        for logger in getattr(self.trainer, "loggers", []):
            if type(logger).__name__ == "WandbLogger":
                drop_unset_wandb_anonymous(logger)
            if type(logger).__name__ == "WandbLogger" and logger.save_dir:
                os.environ.setdefault("WANDB_DIR", str(logger.save_dir))
                os.makedirs(logger.save_dir, exist_ok=True)

    def _refuse_dropped_overrides(self, merged: dict[str, Any] | None) -> None:
        if not merged or not self._requested_model:
            return
        differences = [d for d in differing_options(self._requested_model, merged) if d[0] != "config.vocab_size"]
        if differences:
            self.parser.error(
                f"--ckpt_path: the checkpoint was trained with other model options: "
                f"{describe_differences(differences)}. Resuming uses the checkpoint's; drop these options to resume "
                "it, or leave out --ckpt_path to train a new model with them")

    # LightningCLI runs a method of the CLI named like the subcommand when there is one (else the Trainer's).
    def fit(self, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            if kwargs.get("ckpt_path"):
                # Resuming writes into the run's own checkpoint folder, which is not empty by design: Lightning's
                # notice that it is asks nothing of the user here (a new run into a used folder keeps it).
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            self._run_refusing_bad_input(self.trainer.fit, kwargs)

    def validate(self, **kwargs: Any) -> None:
        self._evaluate("val", self.trainer.validate, kwargs)

    def test(self, **kwargs: Any) -> None:
        self._evaluate("test", self.trainer.test, kwargs)

    def predict(self, **kwargs: Any) -> None:
        self._run_refusing_bad_input(self.trainer.predict, kwargs)

    def _evaluate(self, split: str, run: Any, kwargs: dict[str, Any]) -> None:
        """Validate or test; a multilingual data module's pass ends with the per-language table (rank 0), in place
        of Lightning's, which gives each language's loader a column repeating the same pass-wide metrics. An
        explicit ``--verbose`` keeps Lightning's table as well."""
        languages = list(getattr(self.datamodule, "eval_streams", None) or [])
        if languages and not any(word.split("=", 1)[0] == "--verbose" for word in self._command_line):
            kwargs["verbose"] = False
        results = self._run_refusing_bad_input(run, kwargs)
        table = language_table(results[0] if results else {}, split, languages) if languages else ""
        if table and self.trainer.is_global_zero:
            print(f"{'validation' if split == 'val' else 'test'} per language (loss in nats per token, bits per "
                  f"byte of UTF-8 text, tokens scored on all ranks):\n{table}")

    def _run_refusing_bad_input(self, run: Any, kwargs: dict[str, Any]) -> Any:
        """A refusal before anything trained (the strategy's checks in the launching process, a data or checkpoint
        check on the ranks) ends the command with one line, the other ranks' different errors below it; an error
        once training has started keeps its traceback."""
        batches = _BatchesRun()
        self.trainer.callbacks.append(batches)
        try:
            return run(**kwargs)
        except RankFailed as error:
            sys.stderr.write(f"error: a rank failed, every rank was stopped: {error}\n")
            raise SystemExit(1) from None
        except (ValueError, FileNotFoundError, MisconfigurationException) as error:
            # (a resumed run's global_step is the checkpoint's: what counts is a batch run by this command)
            if batches.started:
                raise
            notes = "".join(f"\n  {note}" for note in getattr(error, "__notes__", []))
            sys.stderr.write(f"error: {error}{notes}\n")
            raise SystemExit(2) from None

    def instantiate_classes(self) -> None:
        # A bad value that only the class can judge (a range, a divisibility, a missing corpus) ends the command
        # with the usual one-line CLI error instead of a traceback, before anything is trained or written.
        # Lightning's Trainer refuses its own options (max_steps=-5, an unknown accelerator) with a
        # MisconfigurationException, which is no ValueError: one line as well.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, MisconfigurationException) as error:
            self.parser.error(str(error))


def strategy_from_class_path(strategy: Any) -> Any:
    """``--trainer.strategy=lightning_p2r.P2RStrategy`` with no init args: the Trainer's ``strategy`` also accepts a
    registry name (a str), so the parser keeps the class path as a plain string, which the Trainer then refuses. A
    dotted path to a Strategy class becomes that class with its defaults."""
    if not isinstance(strategy, str) or "." not in strategy:
        return strategy
    module_name, _, class_name = strategy.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return strategy  # not a class path: the Trainer judges the name
    if isinstance(cls, type) and issubclass(cls, Strategy):
        return Namespace(class_path=strategy, init_args=Namespace())
    return strategy


def unknown_strategy_problem(strategy: Any, registered: list[str]) -> str | None:
    """A ``--trainer.strategy`` that is neither a name Lightning's registry (``registered``) or "auto" knows nor a
    Strategy class path (one is a Namespace by now: :func:`strategy_from_class_path`), with the closest names.
    Lightning's own refusal listed a few example names and its documentation's address: ``P2RStrategy`` (the class
    without its module), ``p2rr`` or ``lightning_p2r.P2RStrategi`` got no pointer to ``lightning_p2r.P2RStrategy``."""
    if not isinstance(strategy, str) or strategy.lower() in ("auto", *registered):
        return None
    close = [] if "." in strategy else difflib.get_close_matches(strategy.lower(), registered, n=3, cutoff=0.6)
    if "p2r" in strategy.lower():
        close = ["lightning_p2r.P2RStrategy", *(name for name in close if name != "p2r"), "p2r"]
    what = "is not an importable Strategy class" if "." in strategy else "is no strategy Lightning has registered"
    hint = f": did you mean {' or '.join(close)}?" if close else ""
    return (f"--trainer.strategy: {strategy!r} {what}{hint} (a registered name such as auto, ddp, fsdp or p2r, or a "
            "Strategy class path such as lightning_p2r.P2RStrategy)")


def _is_p2r_strategy(strategy: Any) -> bool:
    name = strategy.get("class_path") if isinstance(strategy, Namespace) else strategy
    return isinstance(name, str) and (name == "p2r" or name.rsplit(".", 1)[-1] == "P2RStrategy")


def _as_dict(value: Any) -> dict[str, Any] | None:
    if isinstance(value, Namespace):
        return value.as_dict()
    return value if isinstance(value, dict) else None


def place_outputs_under_root(trainer: Namespace) -> list[tuple[Namespace, str, Any]]:
    """Point loggers without a ``save_dir`` at ``trainer.default_root_dir`` and ``ModelCheckpoint`` callbacks without
    a ``dirpath`` at ``<root>/checkpoints``, in the parsed config (before anything is instantiated). Returns each
    ``(init_args, option, value as given)`` it filled: the run's saved ``config.yaml`` keeps the values as given, so
    that reused with another ``default_root_dir`` it writes there (it wrote into the first run's folders)."""
    root = str(trainer.get("default_root_dir") or ".")
    filled: list[tuple[Namespace, str, Any]] = []
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if _is_class(logger, _LOGGERS_WITH_SAVE_DIR) and logger.init_args.get("save_dir") in (None, "."):
            filled.append((logger.init_args, "save_dir", logger.init_args.get("save_dir")))
            logger.init_args.save_dir = root
    callbacks = trainer.get("callbacks")
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if _is_class(callback, ("ModelCheckpoint",)) and callback.init_args.get("dirpath") is None:
            filled.append((callback.init_args, "dirpath", None))
            callback.init_args.dirpath = os.path.join(root, "checkpoints")
    return filled


@contextmanager
def as_given(filled: list[tuple[Namespace, str, Any]]) -> Iterator[None]:
    """The options :func:`place_outputs_under_root` filled, back at their given values for a while."""
    placed = [getattr(args, option) for args, option, _ in filled]
    for args, option, given in filled:
        setattr(args, option, given)
    try:
        yield
    finally:
        for (args, option, _), value in zip(filled, placed):
            setattr(args, option, value)


def checkpoint_folders(trainer: Namespace) -> list[Path]:
    """The configured ``ModelCheckpoint`` folders (filled from ``default_root_dir`` by now)."""
    callbacks = trainer.get("callbacks")
    return [Path(c.init_args.dirpath) for c in (callbacks if isinstance(callbacks, list) else [callbacks])
            if _is_class(c, ("ModelCheckpoint",)) and c.init_args.get("dirpath")]


def newest_last_checkpoint(folders: list[Path]) -> Path | None:
    """The checkpoint ``--ckpt_path last`` names: the newest ``last*.ckpt`` in ``folders``, as Lightning picks it."""
    candidates = [p for folder in folders if folder.is_dir() for p in folder.iterdir()
                  if p.suffix == ".ckpt" and re.match(r"^last(-v?\d+)?$", p.stem)]
    return max(candidates, key=lambda p: p.lstat().st_mtime) if candidates else None


def missing_last_problem(subcommand: str, ckpt_path: Any, folders: list[Path]) -> str | None:
    """``validate``/``test``/``predict --ckpt_path last`` where no ``last*.ckpt`` exists: Lightning warns and runs the
    model as built, untrained, and the command reported its metrics with status 0 (a mistyped
    ``--trainer.default_root_dir``, a run that saved no ``last``). ``fit`` keeps Lightning's meaning (start afresh:
    the idiom of a job that resumes itself when requeued)."""
    if ckpt_path != "last" or subcommand not in ("validate", "test", "predict") or newest_last_checkpoint(folders):
        return None
    where = ", ".join(str(folder) for folder in folders) or "no checkpoint folder (the recipe has no ModelCheckpoint)"
    return (f"--ckpt_path last: there is no last*.ckpt in {where}, and {subcommand} would run the untrained model: "
            "pass the run's --trainer.default_root_dir, or a checkpoint path")


def newest_last_hyperparameters(trainer: Namespace) -> dict[str, Any] | None:
    """The hyperparameters of the checkpoint ``--ckpt_path last`` will resume: the newest ``last*.ckpt`` in the
    configured ``ModelCheckpoint`` folders, as Lightning picks it. None when there is none or it cannot be read
    (the strategy then reports that with the file's name)."""
    newest = newest_last_checkpoint(checkpoint_folders(trainer))
    if newest is None:
        return None
    try:
        source = newest / META_FILE if newest.is_dir() else newest
        return torch.load(source, map_location="cpu", weights_only=True, mmap=not newest.is_dir()).get(
            "hyper_parameters")
    except Exception:  # noqa: BLE001 (an unreadable file is the strategy's to report, with its name)
        return None


def _is_class(entry: Any, names: tuple[str, ...]) -> bool:
    return (isinstance(entry, Namespace) and isinstance(entry.get("class_path"), str)
            and entry.class_path.rsplit(".", 1)[-1] in names and entry.get("init_args") is not None)


def run_lightning_command(argv: list[str], args: list[str] | None) -> None:
    """``fit``, ``validate``, ``test`` or ``predict``: a recipe and its overrides through :class:`P2RCLI`."""
    command = argv[0]
    silence_cli_notices()
    recipe_error = check_recipe_files(recipe_paths(argv))
    if recipe_error:
        sys.stderr.write(f"usage: lightning-p2r {command} [--config RECIPE] [--section.option VALUE ...]\n"
                         f"error: {recipe_error}\n")
        raise SystemExit(2)
    if names_model_class(argv):  # a recipe for another LightningModule (CausalLMModule: docs/your_model.md)
        P2RCLI(LightningModule, TextDataModule, subclass_mode_model=True, args=args)
    else:
        P2RCLI(M6LanguageModel, TextDataModule, args=args)
