"""``lightning-p2r convert``: a checkpoint in the formats users load elsewhere: Hugging Face, safetensors, one file.

Issue 38, item 8.

- ``--to hf``: a ``CausalLMModule`` checkpoint (a single file, or a sharded directory of any layout) as a Hugging
  Face directory (``config.json`` + ``model.safetensors``) that ``AutoModelForCausalLM.from_pretrained`` loads with
  the same logits. The model is rebuilt from the config the checkpoint records, on the meta device, and given the
  checkpoint's tensors; Hugging Face's own ``save_pretrained`` writes it (a tied head stored once).
- ``--to safetensors``: any checkpoint of this package (M6 included) as ``model.safetensors`` (each tensor once, the
  model's own names) and ``config.json`` (its saved hyperparameters, with the structure a pseudo model has now:
  delinked, grown, upcycled).
- ``--to checkpoint``: a sharded checkpoint as one Lightning file (as ``convert-checkpoint``).

The first two describe the model the tensors hold: a pseudo model's Hugging Face form is the model it runs (shared
blocks copied into each layer; a shallow one as deep as its layers).

Every output is written to a hidden sibling and renamed into place: an interrupted conversion leaves no half file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..models.module_init import recompute_buffers
from ..strategy.checkpoint import (
    check_checkpoint_path,
    is_sharded_checkpoint,
    load_meta,
    read_model_state,
    to_single_file,
)
from ..strategy.ties import find_ties

PREFIX = "model."
"""Where ``CausalLMModule`` keeps the model: its state-dict keys start with this."""


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """``(model state dict, hyperparameters, structure records)`` of a single-file or sharded checkpoint, on the
    CPU, loaded safely."""
    if not Path(path).exists():  # before check_checkpoint_path, whose hint is fit's --ckpt_path
        raise ValueError(f"checkpoint {path} does not exist: pass a checkpoint file (a run's newest is "
                         "checkpoints/last.ckpt in its default_root_dir) or a sharded checkpoint directory")
    check_checkpoint_path(path, loads_sharded=True)
    if is_sharded_checkpoint(path):
        state, record = read_model_state(path), load_meta(path)
    else:
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        state = record["state_dict"]
    # The modules' structure records: what a pseudo model became (delinked, grown, upcycled), which the
    # hyperparameters, written when the module was made, do not say.
    from ..causal_lm import STRUCTURE_KEY as CAUSAL_LM_STRUCTURE
    from ..module import STRUCTURE_KEY as M6_STRUCTURE

    structure = {key: record[key] for key in (M6_STRUCTURE, CAUSAL_LM_STRUCTURE) if record.get(key)}
    return state, record.get("hyper_parameters") or {}, structure


def held_hf_config(hyper: dict[str, Any], structure: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config of the model a ``CausalLMModule`` checkpoint holds (a shallow pseudo model not yet
    grown is fewer layers deep than its recorded config)."""
    from ..causal_lm import STRUCTURE_KEY as CAUSAL_LM_STRUCTURE
    from ..causal_lm import hf_config_as_held, read_causal_lm_config
    from ..module import structure_as_held

    hf_config = hyper["hf_config"]
    config = read_causal_lm_config(hf_config)
    depth = int(config.num_hidden_layers)
    depth_key = (getattr(config, "attribute_map", None) or {}).get("num_hidden_layers", "num_hidden_layers")
    held = structure_as_held(hyper, structure.get(CAUSAL_LM_STRUCTURE), depth)
    return hf_config_as_held(hf_config, held, depth, depth_key)


def held_hyperparameters(hyper: dict[str, Any], structure: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters that build the model the checkpoint's tensors hold: the module's own, with the structure
    a pseudo model has now (delinked, grown, upcycled) in place of the one it was created with."""
    from ..causal_lm import STRUCTURE_KEY as CAUSAL_LM_STRUCTURE
    from ..causal_lm import read_causal_lm_config
    from ..module import STRUCTURE_KEY as M6_STRUCTURE
    from ..module import config_as_held, structure_as_held

    if isinstance(hyper.get("config"), dict) and M6_STRUCTURE in structure:
        return {**hyper, "config": config_as_held(hyper["config"], structure[M6_STRUCTURE])}
    if CAUSAL_LM_STRUCTURE in structure:
        if isinstance(hyper.get("hf_config"), dict):
            depth = int(read_causal_lm_config(hyper["hf_config"]).num_hidden_layers)
        elif isinstance(hyper.get("litgpt_config"), dict) and "n_layer" in hyper["litgpt_config"]:
            depth = int(hyper["litgpt_config"]["n_layer"])
        else:  # a model given whole: its depth is not recorded
            return dict(hyper)
        return {**hyper, **structure_as_held(hyper, structure[CAUSAL_LM_STRUCTURE], depth)}
    return dict(hyper)


def hf_model_of(state: dict[str, torch.Tensor], hf_config: dict[str, Any]) -> torch.nn.Module:
    """The Hugging Face model of ``hf_config`` holding ``state`` (the ``CausalLMModule`` keys), built on the meta
    device and given the tensors as they are (each allocated once; a pseudo model's layers sharing a block each get
    their own copy, as the model has no tie between them); refuses a missing or unexpected tensor."""
    from ..causal_lm import build_hf_model

    with torch.device("meta"):
        model = build_hf_model(hf_config)
    tied = {name for names in find_ties(model) for name in names[1:]}
    own: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    for key, value in state.items():
        if not key.startswith(PREFIX):
            continue
        where = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), tuple(value.stride()))
        own[key[len(PREFIX):]] = value.clone() if where in seen and key[len(PREFIX):] not in tied else value
        seen.add(where)
    result = model.load_state_dict(own, strict=False, assign=True)
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint does not hold this model: missing {missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]}")
    model.tie_weights()
    # Computed buffers (rotary tables, Gemma's embedding scale): the model's own rule, on the host, on a twin (the
    # rule of a module holding weights too would redraw them, a trained Gemma embedding among them).
    for name, module in model.named_modules():
        if any(buffer.device.type == "meta" for buffer in module.buffers(recurse=False)):
            recompute_buffers(model, name)
    return model.eval()


def to_hf(source: str | Path, destination: str | Path) -> Path:
    """Write ``source`` (a ``CausalLMModule`` checkpoint) as a Hugging Face directory at ``destination``."""
    state, hyper, structure = read_checkpoint(source)
    if not isinstance(hyper.get("hf_config"), dict):
        kind = ("a CausalLMModule(litgpt_config=...) checkpoint: a litgpt model" if hyper.get("litgpt_config")
                else "an M6LanguageModel checkpoint" if isinstance(hyper.get("config"), dict)
                else "not a CausalLMModule(hf_config=...) checkpoint")
        raise ValueError(f"{source} is {kind}, which records no Hugging Face config: --to hf writes Hugging Face "
                         "models only; use --to safetensors")
    model = hf_model_of(state, held_hf_config(hyper, structure))
    return _write_dir(destination, lambda tmp: model.save_pretrained(tmp, safe_serialization=True))


def to_safetensors(source: str | Path, destination: str | Path) -> Path:
    """Write ``source`` (any checkpoint of this package) as ``model.safetensors`` + ``config.json``."""
    from safetensors.torch import save_file

    state, hyper, structure = read_checkpoint(source)
    hyper = held_hyperparameters(hyper, structure)
    unique: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in state.items():
        # A tied tensor (one storage under two names, however it was loaded): stored once, its other name recorded.
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                 tuple(tensor.stride()))
        if where in seen:
            aliases[key] = seen[where]
            continue
        seen[where] = key
        unique[key] = tensor.contiguous()

    def write(tmp: Path) -> None:
        save_file(unique, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({"hyper_parameters": _plain(hyper), "tied": aliases},
                                                    indent=2, sort_keys=True))

    return _write_dir(destination, write)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else repr(value)


def _write_dir(destination: str | Path, write: Any) -> Path:
    destination = Path(destination)
    partial = destination.with_name(f".{destination.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a failed conversion leaves no hidden half directory
        raise
    if destination.exists():
        shutil.rmtree(destination)
    os.replace(partial, destination)
    return destination


def main(argv: list[str]) -> None:
    """``lightning-p2r convert --to {hf,safetensors,checkpoint} SOURCE DESTINATION``."""
    parser = argparse.ArgumentParser(prog="lightning-p2r convert",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--to", choices=("hf", "safetensors", "checkpoint"), required=True,
                        help="hf: a Hugging Face directory (CausalLMModule checkpoints); safetensors: weights + "
                             "config.json; checkpoint: one Lightning file from a sharded directory")
    args = _parse_source_and_destination(parser, argv, "a checkpoint file or sharded checkpoint directory",
                                         "the directory (hf, safetensors) or file (checkpoint) to write")
    _check_destination(parser, args.source, args.destination, directory=args.to != "checkpoint")
    try:
        if args.to == "hf":
            written = to_hf(args.source, args.destination)
        elif args.to == "safetensors":
            written = to_safetensors(args.source, args.destination)
        else:
            to_single_file(args.source, args.destination)
            written = Path(args.destination)
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(os_error_line(error, args.source, args.destination))
    print(f"wrote {written}")


def convert_checkpoint(argv: list[str]) -> None:
    """``lightning-p2r convert-checkpoint SHARDED_DIR OUT.ckpt``: a sharded checkpoint as one file any strategy
    loads (plain Lightning, DDP, one device)."""
    parser = argparse.ArgumentParser(prog="lightning-p2r convert-checkpoint",
                                     description=(convert_checkpoint.__doc__ or "").replace("``", ""))
    args = _parse_source_and_destination(parser, argv, "a sharded checkpoint directory written by P2RStrategy",
                                         "the single checkpoint file to write")
    _check_destination(parser, args.source, args.destination, directory=False)
    try:
        checkpoint = to_single_file(args.source, args.destination)
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(os_error_line(error, args.source, args.destination))
    print(f"wrote {args.destination}: {len(checkpoint['state_dict'])} tensors, "
          f"{len(checkpoint['optimizer_states'])} optimizer state(s), step {checkpoint.get('global_step')}")


def os_error_line(error: OSError, source: str, destination: str) -> str:
    """One line for a file a conversion could not read or write, naming it (a destination in a folder that cannot
    be made, as ``/proc/x/out.ckpt``, ended in a FileNotFoundError traceback)."""
    where = Path(error.filename or destination).resolve()
    reason = error.strerror or str(error)
    source_path = Path(source).resolve()
    if where == source_path or source_path in where.parents:
        return f"cannot read {error.filename} ({reason}): check the checkpoint's files and their permissions"
    return (f"cannot write {destination} ({reason}: {error.filename or destination}): choose a destination in a "
            "folder you can create and write")


def _parse_source_and_destination(parser: argparse.ArgumentParser, argv: list[str], source: str,
                                  destination: str) -> argparse.Namespace:
    """Both conversions' positional SOURCE and DESTINATION and ``--overwrite``, parsed; an existing destination
    is refused unless ``--overwrite`` (nothing earlier is lost by a typo)."""
    parser.add_argument("source", help=source)
    parser.add_argument("destination", help=destination)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    args = parser.parse_args(argv)
    if os.path.exists(args.destination) and not args.overwrite:
        parser.error(f"{args.destination} exists: pass --overwrite to replace it, or choose another name")
    return args


def _check_destination(parser: argparse.ArgumentParser, source: str, destination: str, directory: bool) -> None:
    """Refuse a destination whose writing would destroy what no conversion wrote, ``--overwrite`` or not (a new-user
    audit: ``convert --to safetensors SRC SRC --overwrite`` deleted the checkpoint it converted, and a prepared-data
    folder given as destination went too): the source itself, a folder holding it or inside it, and an existing
    destination of the other kind (a folder for a file, or a folder without the ``config.json`` every folder this
    command writes has)."""
    source_path, target = Path(source).resolve(), Path(destination).resolve()
    if target == source_path or target in source_path.parents or source_path in target.parents:
        parser.error(f"{destination} would replace or sit inside the checkpoint it converts ({source}): choose a "
                     "destination outside it")
    if not target.exists():
        return
    if directory and not (target.is_dir() and (target / "config.json").is_file()):
        parser.error(f"{destination} exists and is not a folder this command wrote (no config.json): it replaces "
                     "only its own output, even with --overwrite; choose another destination")
    if not directory and target.is_dir():
        parser.error(f"{destination} is a folder: this conversion writes one checkpoint file; choose a file name")
