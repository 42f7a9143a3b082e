"""``lightning-p2r generate``: sample text from a trained checkpoint with the recipe's model and tokenizer.

The recipe (the YAML ``lightning-p2r fit --config`` took, or the ``config.yaml`` a run wrote) gives the model
(``model.config``) and the tokenizer (``data``), linked as the training CLI links them: the model's vocabulary
size is the tokenizer's, its ``max_seq_len`` is ``data.seq_len``. The checkpoint is a single file, or a sharded
directory written by P2RStrategy, read whole into one process as it is (no converted file is written first),
whatever layout saved it. Every check on the inputs runs before the first token is generated, and a refused input
ends the command with one line that names it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..data import TextDataModule, TextTokenizer
from ..generation import check_request, largest_new_tokens, prompt_too_long
from ..models import M6Config
from ..module import M6LanguageModel
from ..strategy.checkpoint import check_checkpoint_path, is_sharded_checkpoint, load_meta, read_model_state
from .options_diff import describe_differences, differing_options
from .recipe_files import check_recipe_files, locate_key

# M6Config fields that do not change what a trained model computes at inference (training-only settings, the
# init), or that the weights' shapes and the saved structure already check: a recipe may differ from the
# checkpoint's options in these.
_INFERENCE_NEUTRAL = {"capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "router_jitter", "dropout",
                      "init_seed", "init_std", "residual_init", "vocab_size", "max_seq_len", "num_unique_blocks"}


class GenerateError(ValueError):
    """A refused input, reported as one line naming it."""


@dataclass(frozen=True)
class Recipe:
    """What generation reads from a recipe: the model's config and the data module (for its tokenizer)."""

    path: Path
    config: M6Config
    data: TextDataModule
    checkpoint_folders: tuple[Path, ...] = ()
    """Where the recipe's fit writes checkpoints: ``<trainer.default_root_dir>/checkpoints`` and the ``dirpath`` of
    each ``ModelCheckpoint`` (``--ckpt_path last`` takes the newest ``last*.ckpt`` among them)."""


def read_recipe(path: str | Path) -> Recipe:
    """The model config and data module of recipe ``path``, linked as ``P2RCLI`` links them (vocabulary size from
    the data, ``max_seq_len`` from ``data.seq_len``)."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise GenerateError(f"--config: recipe {path} does not exist (for example: --config recipes/quickstart.yaml)")
    problem = check_recipe_files([str(path)])  # the file's syntax, named as fit names it (file, line, column)
    if problem:
        raise GenerateError(f"--config: {problem}")
    recipe = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    model = _section(recipe, "model", path)
    config_options = dict(_section(model, "config", path, "model.config"))
    data_options = dict(_section(recipe, "data", path))
    try:
        data = TextDataModule(**data_options)
    except (TypeError, ValueError, FileNotFoundError) as error:
        raise GenerateError(f"--config: {path}: data: {_one_line(error)}") from error
    config_options |= {"vocab_size": data.vocab_size, "max_seq_len": data.seq_len}
    unknown = sorted(set(config_options) - {f.name for f in fields(M6Config)})
    if unknown:
        where = locate_key([str(path)], f"model.config.{unknown[0]}")
        raise GenerateError(f"--config: {path}: model.config has no option {unknown[0]!r}"
                            + (f" (in {where})" if where else ""))
    try:
        config = M6Config(**config_options)
    except (TypeError, ValueError) as error:
        raise GenerateError(f"--config: {path}: {_one_line(error)}") from error
    return Recipe(path=path, config=config, data=data, checkpoint_folders=checkpoint_folders(recipe))


def checkpoint_folders(recipe: dict[str, Any]) -> tuple[Path, ...]:
    """The folders where ``lightning-p2r fit`` with this recipe writes checkpoints (as ``P2RCLI`` places them:
    ``<default_root_dir>/checkpoints`` unless a ``ModelCheckpoint`` names its ``dirpath``)."""
    trainer = recipe.get("trainer") if isinstance(recipe.get("trainer"), dict) else {}
    folders = [Path(str(trainer.get("default_root_dir") or ".")) / "checkpoints"]
    callbacks = trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        options = callback.get("init_args") if isinstance(callback, dict) else None
        if (str(callback.get("class_path", "")).rsplit(".", 1)[-1] == "ModelCheckpoint" and isinstance(options, dict)
                and options.get("dirpath")):
            folders.append(Path(str(options["dirpath"])))
    return tuple(dict.fromkeys(folders))


def resolve_checkpoint(ckpt_path: str, recipe: Recipe) -> str:
    """``ckpt_path`` itself, or for ``last`` the newest ``last*.ckpt`` (``last.ckpt``, ``last-v1.ckpt``, ...) in the
    recipe's checkpoint folders, as ``lightning-p2r fit --ckpt_path last`` picks it. Lightning's other names
    (``best``, ``hpc``, ``registry``) need a running Trainer: refused."""
    if ckpt_path in ("best", "hpc", "registry") or ckpt_path.startswith("registry:"):
        raise GenerateError(f"--ckpt_path: {ckpt_path!r} is resolved by a running Trainer, which generate does not "
                            "start: pass a checkpoint file or directory, or 'last'")
    if ckpt_path != "last":
        return ckpt_path
    candidates = [p for folder in recipe.checkpoint_folders if folder.is_dir() for p in folder.iterdir()
                  if p.suffix == ".ckpt" and re.fullmatch(r"last(-v?\d+)?", p.stem)]
    if not candidates:
        folders = ", ".join(str(folder) for folder in recipe.checkpoint_folders)
        raise GenerateError(f"--ckpt_path last: no last*.ckpt in {folders} (the checkpoint folder of recipe "
                            f"{recipe.path}): train first (lightning-p2r fit --config {recipe.path}), or pass a "
                            "checkpoint path")
    return str(max(candidates, key=lambda p: p.lstat().st_mtime))


def _section(mapping: dict[str, Any], key: str, path: Path, name: str | None = None) -> dict[str, Any]:
    value = mapping.get(key) or {}
    if not isinstance(value, dict):
        raise GenerateError(f"--config: {path}: {name or key} must be a mapping of options, got {value!r}")
    return value


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def recipe_tokenizer(data: TextDataModule) -> TextTokenizer:
    """The tokenizer training used: the prepared directory's, or the same corpus, kind and size give the same
    (cached) tokenizer. A recipe whose prepared corpus is not on this machine (``data.prepared: auto`` before its
    first fit here) is refused in one line, not a traceback."""
    from ..data.prepared import PreparedDataError

    try:
        return data.load_tokenizer()
    except PreparedDataError as error:
        raise GenerateError(f"--config: the recipe's tokenizer comes from its prepared corpus, which is not ready "
                            f"here: {_one_line(error)} (a fit of the recipe on this machine prepares it)") from error


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(model state dict, everything else saved)`` of a single-file or sharded checkpoint, on the CPU."""
    try:
        check_checkpoint_path(path, loads_sharded=True)
    except ValueError as error:
        raise GenerateError(f"--ckpt_path: {error}") from error
    if is_sharded_checkpoint(path):
        return read_model_state(path), load_meta(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return checkpoint.pop("state_dict"), checkpoint


def load_model(recipe: Recipe, state: dict[str, torch.Tensor], saved: dict[str, Any],
               ckpt_path: str | Path) -> M6LanguageModel:
    """A one-process :class:`M6LanguageModel` of the recipe's config holding the checkpoint's weights; refuses a
    checkpoint of another model (its options, its saved structure or a tensor's shape) naming the difference."""
    module = M6LanguageModel(recipe.config)
    trained = (saved.get("hyper_parameters") or {}).get("config")
    differences = [(f"config.{name}", mine, theirs) for name, mine, theirs in
                   differing_options(recipe.config.to_dict(), trained if isinstance(trained, dict) else {})
                   if name not in _INFERENCE_NEUTRAL]
    try:
        module.on_load_checkpoint(saved)  # rebuilds a delinked model's blocks before the weights arrive
        mismatch = first_mismatch(module.state_dict(), state)
    except ValueError as error:  # a saved structure this config cannot take
        mismatch = _one_line(error)
    problems = [problem for problem in (mismatch, differences and "the recipe's options differ: "
                                        + describe_differences(differences)) if problem]
    if problems:
        raise GenerateError(f"--ckpt_path: {ckpt_path} holds another model than recipe {recipe.path}: "
                            f"{'; '.join(problems)}. Pass the recipe the checkpoint was trained with")
    module.load_state_dict(state)
    return module.eval()


def first_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str | None:
    """The first tensor (in the model's order) that the checkpoint lacks or holds in another shape, or the first
    one it holds that the model has not; None when the two state dicts have the same names and shapes."""
    for name, tensor in expected.items():
        if name not in found:
            return f"it has no tensor {name}, which the recipe's model has (shape {list(tensor.shape)})"
        if found[name].shape != tensor.shape:
            return (f"tensor {name} is {list(found[name].shape)} in the checkpoint but {list(tensor.shape)} in the "
                    "recipe's model")
    extra = [name for name in found if name not in expected]
    if extra:
        return f"it holds tensor {extra[0]} (shape {list(found[extra[0]].shape)}), which the recipe's model has not"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-p2r generate",
        description="Sample text from a trained checkpoint with the model and tokenizer of its recipe.",
        usage="lightning-p2r generate --config RECIPE --ckpt_path CKPT --prompt TEXT [options]")
    parser.add_argument("--config", required=True, metavar="RECIPE",
                        help="the recipe the checkpoint was trained with (recipes/*.yaml, or a run's config.yaml)")
    parser.add_argument("--ckpt_path", required=True, metavar="CKPT",
                        help="a checkpoint file, a sharded checkpoint directory written by P2RStrategy, or 'last': "
                             "the newest last*.ckpt of the recipe's run (trainer.default_root_dir/checkpoints)")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=None, metavar="N",
                        help="tokens to generate; prompt and continuation must fit the model's context "
                             "(data.seq_len); default: as many as fit")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="sampling temperature; 0 is greedy decoding (deterministic) (default: 0.8)")
    parser.add_argument("--top_k", type=int, default=50, metavar="K",
                        help="sample among the K most likely tokens, 1 to the vocabulary size (default: 50)")
    parser.add_argument("--seed", type=int, default=1234, metavar="S",
                        help="seed of the sampling: the same seed gives the same text (default: 1234)")
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help="where to run: cpu, cuda, cuda:1, ...; auto takes the GPU when there is one "
                             "(default: auto)")
    return parser


def main(argv: list[str]) -> None:
    """Entry point of ``lightning-p2r generate`` (``argv``: the arguments after ``generate``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except GenerateError as error:
        parser.error(str(error))


def run(args: argparse.Namespace) -> None:
    """Check every input, then generate and print the text, and the speed on stderr."""
    device = _check_options(args)
    recipe = read_recipe(args.config)
    config = recipe.config
    if args.top_k > config.vocab_size:
        raise GenerateError(f"--top_k {args.top_k} is larger than the vocabulary ({config.vocab_size} tokens, "
                            f"data.vocab_size of {recipe.path}): choose 1 to {config.vocab_size}")
    ckpt_path = resolve_checkpoint(args.ckpt_path, recipe)
    try:
        # Before the tokenizer, so that a typo fails at once; the bytes are checked as the checkpoint is read.
        check_checkpoint_path(ckpt_path, loads_sharded=True, integrity=False)
    except ValueError as error:
        raise GenerateError(f"--ckpt_path: {error}") from error
    tokenizer = recipe_tokenizer(recipe.data)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise GenerateError(f"--prompt: {args.prompt!r} tokenizes to no token: give at least one character of text")
    if len(prompt) >= config.max_seq_len:
        raise GenerateError(f"--prompt: {prompt_too_long(len(prompt), config.max_seq_len)}")
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = largest_new_tokens(len(prompt), config.max_seq_len)
    try:
        check_request(len(prompt), max_new_tokens, config.max_seq_len)
    except ValueError as error:
        raise GenerateError(f"--max_new_tokens: {error}") from error
    state, saved = read_checkpoint(ckpt_path)
    module = load_model(recipe, state, saved, ckpt_path)
    del state
    module.to(device)

    start = time.perf_counter()
    tokens = module.generate(prompt, max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k if args.temperature > 0 else None, seed=args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    print(tokenizer.decode(tokens.tolist()))
    print(f"{max_new_tokens} tokens in {seconds:.2f} s: {max_new_tokens / max(seconds, 1e-9):.1f} tokens/s "
          f"(prompt {len(prompt)} tokens, {device.type})", file=sys.stderr)


def _check_options(args: argparse.Namespace) -> torch.device:
    """The checks that need nothing but the options; returns the device to run on."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise GenerateError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature < math.inf:
        raise GenerateError(f"--temperature must be a finite number >= 0 (0 is greedy decoding), got "
                            f"{args.temperature}")
    if args.top_k < 1:
        raise GenerateError(f"--top_k must be >= 1 (1 is greedy decoding), got {args.top_k}")
    return _device(args.device)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise GenerateError(f"--device: {name!r} is not a device (cpu, cuda, cuda:1, ... or auto)") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"--device: {name} was asked for but this machine has no usable CUDA GPU")
    return device
