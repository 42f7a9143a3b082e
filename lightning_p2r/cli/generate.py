"""``lightning-p2r generate``: sample text from a trained checkpoint with the recipe's model and tokenizer.

The recipe (the YAML ``lightning-p2r fit --config`` took, or the ``config.yaml`` a run wrote) gives the model and
the tokenizer (``data``), linked as the training CLI links them: the model's vocabulary size is the tokenizer's, and
a sequence is at most ``data.seq_len`` tokens. The model is an ``M6LanguageModel`` (``model.config``) or a
``CausalLMModule`` (``model.class_path``, built from its ``init_args``' ``hf_config`` or ``litgpt_config``). The
checkpoint is a single file, or a sharded directory written by P2RStrategy, read whole into one process as it is
(no converted file is written first), whatever layout saved it. Every check on the inputs runs before the first
token is generated, and a refused input ends the command with one line that names it.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..causal_lm import CausalLMModule, hf_config_object
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

# The same for a CausalLMModule: its arguments that only shape training or the initial values, and fields of its
# Hugging Face or litgpt config that act only in training (dropouts, router losses and noise), at init, or that the
# tensors' shapes check (the vocabulary, linked from the data).
_CAUSAL_LM_INFERENCE_NEUTRAL = {"optimizer", "init_seed", "parts", "vocab_size", "num_unique_blocks", "growth_init"}
_CONFIG_INFERENCE_NEUTRAL = {"vocab_size", "padded_vocab_size", "initializer_range", "use_cache",
                             "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout",
                             "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"}


class GenerateError(ValueError):
    """A refused input, reported as one line naming it."""


@dataclass(frozen=True)
class Recipe:
    """What generation reads from a recipe: the model (an M6 config, or a CausalLMModule's arguments) and the data
    module (for its tokenizer)."""

    path: Path
    config: M6Config | None
    """The M6 model's config (``model.config``); None when the recipe's model is a ``CausalLMModule``."""
    data: TextDataModule
    checkpoint_folders: tuple[Path, ...] = ()
    """Where the recipe's fit writes checkpoints: ``<trainer.default_root_dir>/checkpoints`` and the ``dirpath`` of
    each ``ModelCheckpoint`` (``--ckpt_path last`` takes the newest ``last*.ckpt`` among them)."""
    causal_lm: dict[str, Any] | None = None
    """``CausalLMModule``'s arguments (``model.init_args``, with the data's vocabulary size as ``fit`` links it);
    None for an M6 recipe."""

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model trained on: prompt and continuation must fit it."""
        return self.data.seq_len


def read_recipe(path: str | Path) -> Recipe:
    """The model and data module of recipe ``path``, linked as ``P2RCLI`` links them (vocabulary size from the
    data, an M6 model's ``max_seq_len`` from ``data.seq_len``)."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise GenerateError(f"--config: recipe {path} does not exist (for example: --config recipes/quickstart.yaml)")
    problem = check_recipe_files([str(path)])  # the file's syntax, named as fit names it (file, line, column)
    if problem:
        raise GenerateError(f"--config: {problem}")
    recipe = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    model = _section(recipe, "model", path)
    if "class_path" in model:  # a recipe naming its model's class, as fit reads it (names_model_class)
        data = _data_module(recipe, path)
        return Recipe(path=path, config=None, data=data, checkpoint_folders=checkpoint_folders(recipe),
                      causal_lm=causal_lm_arguments(model, data, path))
    config_options = dict(_section(model, "config", path, "model.config"))
    data = _data_module(recipe, path)
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


def _data_module(recipe: dict[str, Any], path: Path) -> TextDataModule:
    try:
        return TextDataModule(**_section(recipe, "data", path))
    except (TypeError, ValueError, FileNotFoundError) as error:
        raise GenerateError(f"--config: {path}: data: {_one_line(error)}") from error


def causal_lm_arguments(model: dict[str, Any], data: TextDataModule, path: Path) -> dict[str, Any]:
    """``CausalLMModule``'s arguments from a recipe's ``model`` section (``class_path`` and ``init_args``), with the
    data's vocabulary size as ``fit`` links it. Refused in one line: another class, an argument ``CausalLMModule``
    has not, a model given whole (its code is the caller's: generate rebuilds a model from its config only), and
    arguments the module or the Hugging Face config refuses."""
    class_path = str(model["class_path"])
    if class_path.rsplit(".", 1)[-1] != "CausalLMModule":
        raise GenerateError(f"--config: {path}: model.class_path {class_path}: generate builds only "
                            "lightning_p2r.CausalLMModule (from hf_config or litgpt_config) and the M6 model "
                            "(model.config, no class_path)")
    arguments = dict(_section(model, "init_args", path, "model.init_args"))
    unknown = sorted(set(arguments) - set(inspect.signature(CausalLMModule).parameters))
    if unknown:
        where = locate_key([str(path)], f"model.{unknown[0]}")  # init_args is looked through
        raise GenerateError(f"--config: {path}: CausalLMModule has no argument {unknown[0]!r} (model.init_args"
                            + (f", in {where})" if where else ")"))
    if arguments.get("model") is not None:
        raise GenerateError(f"--config: {path}: model.init_args.model gives the model whole, which generate cannot "
                            "rebuild: give the recipe hf_config or litgpt_config, or load the checkpoint's state "
                            "into your model in Python and call CausalLMModule.generate (docs/generation.md)")
    arguments["vocab_size"] = data.vocab_size  # as fit links data.vocab_size (the recipe's own value is replaced)
    try:
        # Its own checks, the hf_config read by transformers among them (a missing model_type, a misspelled or
        # refused field): the model itself is built once the checkpoint is read.
        CausalLMModule(**arguments)
    except (TypeError, ValueError, ImportError) as error:
        raise GenerateError(f"--config: {path}: model.init_args: {_one_line(error)}") from error
    return arguments


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
               ckpt_path: str | Path) -> M6LanguageModel | CausalLMModule:
    """A one-process module of the recipe's model (:class:`M6LanguageModel`, or :class:`CausalLMModule`) holding
    the checkpoint's weights; refuses a checkpoint of another model (its options, its saved structure or a tensor's
    shape) naming the difference."""
    hyper_parameters = saved.get("hyper_parameters") or {}
    if recipe.causal_lm is not None:
        module = CausalLMModule(**recipe.causal_lm)
        try:
            # Built eagerly with random values, which the checkpoint's then replace: a build on the meta device
            # would need each family's computed buffers (rotary tables) recomputed apart.
            module.configure_model()
        except (ValueError, ImportError) as error:  # litgpt not installed, layers that cannot share a block
            raise GenerateError(f"--config: {recipe.path}: model.init_args: {_one_line(error)}") from error
        differences = [(name, mine, theirs) for name, mine, theirs in
                       differing_options(_filled_in(recipe.causal_lm), _filled_in(hyper_parameters))
                       if not _causal_lm_neutral(name)]
        prefix = "model.init_args."
    else:
        module = M6LanguageModel(recipe.config)
        trained = hyper_parameters.get("config")
        differences = [(f"config.{name}", mine, theirs) for name, mine, theirs in
                       differing_options(recipe.config.to_dict(), trained if isinstance(trained, dict) else {})
                       if name not in _INFERENCE_NEUTRAL]
        prefix = "model."
    try:
        module.on_load_checkpoint(saved)  # rebuilds a delinked model's blocks before the weights arrive
        mismatch = first_mismatch(module.state_dict(), state)
    except ValueError as error:  # a saved structure this config cannot take
        mismatch = _one_line(error)
    writer, builder = _module_class(hyper_parameters), type(module).__name__
    problems = [problem for problem in (mismatch, differences and "the recipe's options differ: "
                                        + describe_differences(differences, prefix),
                                        writer not in (None, builder) and f"{writer} wrote it, the recipe builds "
                                        f"{builder}") if problem]
    if problems:
        raise GenerateError(f"--ckpt_path: {ckpt_path} holds another model than recipe {recipe.path}: "
                            f"{'; '.join(problems)}. Pass the recipe the checkpoint was trained with")
    module.load_state_dict(state)
    return module.eval()


def _module_class(hyper_parameters: dict[str, Any]) -> str | None:
    """Which of the two modules wrote a checkpoint, from the hyperparameters it saved (None: neither says)."""
    if "config" in hyper_parameters:
        return "M6LanguageModel"
    if {"hf_config", "litgpt_config"} & hyper_parameters.keys():
        return "CausalLMModule"
    return None


def _filled_in(arguments: dict[str, Any]) -> dict[str, Any]:
    """``CausalLMModule``'s arguments with ``hf_config`` as Hugging Face fills it in (every field, defaults
    included): a field one side sets and the other leaves at its default is then compared too."""
    hf_config = arguments.get("hf_config")
    if not isinstance(hf_config, dict):
        return arguments
    try:
        return arguments | {"hf_config": hf_config_object(hf_config).to_dict()}
    except ValueError:  # a config this transformers cannot read: compared as written
        return arguments


def _causal_lm_neutral(name: str) -> bool:
    """Whether the ``CausalLMModule`` option ``name`` (dotted: ``hf_config.hidden_size``) may differ between a
    recipe and its checkpoint."""
    top, _, field = name.partition(".")
    return top in _CAUSAL_LM_INFERENCE_NEUTRAL or field in _CONFIG_INFERENCE_NEUTRAL


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
    parser.add_argument("-c", "--config", required=True, metavar="RECIPE",
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
    if args.top_k > recipe.vocab_size:
        raise GenerateError(f"--top_k {args.top_k} is larger than the vocabulary ({recipe.vocab_size} tokens, "
                            f"data.vocab_size of {recipe.path}): choose 1 to {recipe.vocab_size}")
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
    if len(prompt) >= recipe.max_seq_len:
        raise GenerateError(f"--prompt: {prompt_too_long(len(prompt), recipe.max_seq_len)}")
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = largest_new_tokens(len(prompt), recipe.max_seq_len)
    try:
        check_request(len(prompt), max_new_tokens, recipe.max_seq_len)
    except ValueError as error:
        raise GenerateError(f"--max_new_tokens: {error}") from error
    state, saved = read_checkpoint(ckpt_path)
    module = load_model(recipe, state, saved, ckpt_path)
    del state
    module.to(device)

    start = time.perf_counter()
    sampling = {"temperature": args.temperature, "top_k": args.top_k if args.temperature > 0 else None,
                "seed": args.seed}
    if isinstance(module, CausalLMModule):  # its decoder does not know the windows it trained on: data.seq_len
        sampling["max_seq_len"] = recipe.max_seq_len
    tokens = module.generate(prompt, max_new_tokens, **sampling)
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
