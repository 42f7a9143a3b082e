"""``lightning-p2r plan``: the fastest layouts of a recipe's model on a cluster, with their memory and time.

    lightning-p2r plan --cluster cluster.yaml --config recipes/m6_moe_small.yaml [--devices 64] [--top 5]

The model is the recipe's ``model.config``; the batch is the recipe's (``data.batch_size`` per data-parallel rank,
times its data ranks) unless ``--global-batch`` says otherwise; ``seq_len`` and ``trainer.precision`` come from
it too. The cluster file comes from ``lightning-p2r calibrate`` (this machine) or is written by hand
(``docs/planning.md`` lists its fields).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import difflib
from pathlib import Path
from typing import Any

from ..models.config import M6Config
from .cluster import SIZE_DEPENDENT_LAYER_COSTS, Cluster, at_speed, cluster_for, load_cluster
from .framework import HOW_TO_GET, missing_terms
from .hf_decoder import HFDecoder, hf_decoder_of
from .layout import SCHEDULES, SHARDINGS, Layout, Workload
from .model import PricedModel, embedding_dropout_elements, layer_dropout_elements, parameter_count, pseudo_of
from .search import Plan, SearchSpace, equivalence_key, evaluate, search
from .step_time import fitted_step_range

GB = 1e9
TRIAL_STEPS = 20
"""Optimizer steps per trial unless ``--trial-steps`` says otherwise (the first 2 untimed)."""


def recipe_inputs(path: str | Path) -> tuple[PricedModel, dict[str, Any]]:
    """The model config and the run settings (batch_size, seq_len, precision, the recipe's data ranks) of a
    recipe."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {path} does not exist")
    recipe = yaml.safe_load(path.read_text()) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"{path}: a recipe is a mapping of sections (trainer, model, data), got {recipe!r}")
    unknown = sorted(set(recipe) - set(RECIPE_SECTIONS))
    if unknown:
        cluster_fields = {f.name for f in dataclasses.fields(Cluster)}
        hint = ("; it looks like a cluster file: pass it to --cluster, and the recipe to --config"
                if set(recipe) & cluster_fields and not set(recipe) & {"trainer", "model", "data"} else "")
        named = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        raise ValueError(f"{path}: unknown recipe section(s) {named} (a recipe has {', '.join(RECIPE_SECTIONS)})"
                         + hint)
    trainer = recipe.get("trainer") or {}
    data = recipe.get("data") or {}
    check_strategy_options(trainer, path)
    # Linked as `lightning-p2r fit` links them: the data's sequence length and vocabulary size are the model's.
    vocab_size = data.get("vocab_size") or (256 if data.get("tokenizer") == "bytes" else None)
    hf_config = hf_config_of(recipe.get("model") or {}, path)
    if hf_config is not None:
        # ``fit`` links the data module's vocabulary into the model over any the hf_config names: its default where
        # the recipe names none, not the family's (Llama's 32,000, Qwen's 151,936).
        linked_vocab = vocab_size or _data_default_vocab(data)
        try:
            config: PricedModel = hf_decoder_of(hf_config | {"vocab_size": linked_vocab})
        except ValueError as error:
            raise ValueError(f"{path}: model.init_args.{error}") from None
        return config, _settings(trainer, data)
    model = m6_config_of(recipe.get("model") or {}, path)
    known = {f.name for f in dataclasses.fields(M6Config)}
    for key in model:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ValueError(f"{path}: model.config.{key} is not an M6Config field"
                             + (f"; did you mean {close[0]}?" if close else ""))
    linked = {"max_seq_len": data.get("seq_len", 128)} | ({"vocab_size": vocab_size} if vocab_size else {})
    try:
        config = M6Config(**(model | linked))
    except ValueError as error:
        raise ValueError(f"{path}: model.config: {error}") from None
    return config, _settings(trainer, data)


def _data_default_vocab(data: dict[str, Any]) -> int:
    """The vocabulary the data module gives a recipe that names none: a prepared corpus's (its manifest), else the
    tokenizer's default."""
    from ..data.tokenizer import BYTE_VOCAB, DEFAULT_BPE_VOCAB

    prepared = data.get("prepared")
    if isinstance(prepared, str) and prepared != "auto":
        from ..data.prepared import PreparedDataError, read_manifest

        try:
            return read_manifest(prepared).vocab_size
        except PreparedDataError:
            pass  # the data module names what is wrong with it when the run starts
    return BYTE_VOCAB if data.get("tokenizer") == "bytes" else DEFAULT_BPE_VOCAB


def _settings(trainer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The run settings the workload is priced at: the batch per data rank, the sequence length, the precision, the
    recipe's data ranks and its Trainer's accumulation."""
    strategy = ((trainer.get("strategy") or {}).get("init_args") or {}) if isinstance(trainer.get("strategy"),
                                                                                      dict) else {}
    devices = trainer.get("devices", 1)
    devices = devices if isinstance(devices, int) else 1
    data_ranks = max(1, devices // (strategy.get("tensor_parallel", 1) * strategy.get("pipeline_parallel", 1)))
    settings = {"batch_size": data.get("batch_size", 16), "seq_len": data.get("seq_len", 128),
                "precision": str(trainer.get("precision", "32-true")), "data_ranks": data_ranks,
                "accumulate": trainer.get("accumulate_grad_batches", 1), "strategy": trainer.get("strategy")}
    return settings


PLAIN_STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "single_device")
"""Lightning's strategy names whose layout is the planner's plain one (one process, or every rank a whole
replica): ``Layout()``, as the recipe's Trainer accumulates."""


def recipe_layout(settings: dict[str, Any]) -> tuple[Layout | None, str]:
    """The layout the recipe runs as written (its ``P2RStrategy`` options, or plain for Lightning's default and DDP
    strategies) and a description; None with the reason where the planner cannot price it."""
    strategy = settings.get("strategy")
    accumulate = settings.get("accumulate", 1)
    plain = {"micro_batches": accumulate} if isinstance(accumulate, int) and accumulate > 1 else {}
    if strategy is None or (isinstance(strategy, str) and strategy in PLAIN_STRATEGIES):
        layout = Layout(**plain)
        return layout, f"{layout.describe()}, Lightning's {strategy or 'auto'} strategy"
    if not isinstance(strategy, dict) or str(strategy.get("class_path", "")).rsplit(".", 1)[-1] != "P2RStrategy":
        name = strategy.get("class_path") if isinstance(strategy, dict) else strategy
        return None, f"its strategy {name} is not one the planner prices (P2RStrategy, or Lightning's auto and ddp)"
    options = dict(strategy.get("init_args") or {})
    if options.get("device_memory_budget") is not None:
        return None, ("its device_memory_budget decides at setup which blocks to offload, from the model's sizes on "
                      "the machine: compare the offload_fraction rows")
    if options.get("pipeline_parallel", 1) == 1 and options.get("accumulation", "standard") == "standard":
        options = plain | options  # standard accumulation off a pipeline is the Trainer's
    layout = layout_from_options(options)
    return layout, layout.describe()


def recipe_layout_line(config: PricedModel, settings: dict[str, Any], plans: list[Plan], cluster: Cluster,
                       workload: Workload, memory_headroom: float) -> str:
    """How the recipe's own layout compares with the plan's: its step and rank among the layouts that fit, or why
    it does not fit or run there, or why it is not priced."""
    layout, description = recipe_layout(settings)
    if layout is None:
        return f"the recipe's own layout is not priced: {description}"
    try:
        own = evaluate(config, layout, cluster, workload, memory_headroom=memory_headroom)
    except ValueError as error:
        return f"the recipe's own layout ({description}) cannot run on {cluster.devices} devices: {error}"
    if not own.fits:
        return f"the recipe's own layout ({description}) does not fit: {own.reason}"
    if not plans:
        return f"the recipe's own layout ({description}): {own.step.total:.3g} s per step; no searched layout fits"
    key = equivalence_key(layout, cluster.devices)
    faster = sum(plan.step.total < own.step.total for plan in plans
                 if equivalence_key(plan.layout, cluster.devices) != key)
    return (f"the recipe's own layout ({description}): {own.step.total:.3g} s per step, "
            f"{own.step.total / plans[0].step.total:.2f}x the best layout's; {faster} of the {len(plans)} that fit "
            "are faster")


P2R_STRATEGY_OPTIONS = (
    "sharding", "count_collectives", "tensor_parallel", "expert_parallel", "sequence_parallel", "pipeline_parallel",
    "pipeline_schedule", "stages_per_rank", "accumulation", "micro_batches", "recompute", "compile",
    "reduce_every_micro_batch", "offload_fraction", "offload_blocks", "device_memory_budget", "activation_allowance",
    "offload_states", "prefetch", "pin_memory", "overlap_host_step", "host_step", "log_telemetry", "host_allocator",
    "blocks", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout")
"""``P2RStrategy``'s keywords, spelled out so the planner checks a recipe's without importing the strategy (and
torch); tests/unit/test_planning_cli.py keeps this equal to the signature."""


def check_strategy_options(trainer: dict[str, Any], path: Path) -> None:
    """Refuse a ``trainer.strategy.init_args`` name P2RStrategy does not take (``offload_fracton``): unchecked, the
    plan priced the run without it, where ``lightning-p2r fit`` refuses the recipe."""
    strategy = trainer.get("strategy") if isinstance(trainer, dict) else None
    if not isinstance(strategy, dict) or str(strategy.get("class_path", "")).rsplit(".", 1)[-1] != "P2RStrategy":
        return  # a strategy name, or another class: fit's parser judges its options
    options = strategy.get("init_args") or {}
    for key in options if isinstance(options, dict) else ():
        if key not in P2R_STRATEGY_OPTIONS:
            close = difflib.get_close_matches(str(key), P2R_STRATEGY_OPTIONS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else "docs/configuration.md lists its options"
            raise ValueError(f"{path}: trainer.strategy.init_args.{key} is not an option of P2RStrategy ({hint})")


RECIPE_SECTIONS = ("seed_everything", "trainer", "model", "data", "ckpt_path", "optimizer", "lr_scheduler",
                   "throughput")
"""The top-level sections ``lightning-p2r fit`` reads from a recipe (LightningCLI's, and the throughput callback's)."""
M6_MODULE_OPTIONS = ("config", "optimizer")
"""What a recipe's ``model`` section holds for ``M6LanguageModel``, written either way LightningCLI reads it."""


CAUSAL_LM_PRICED = ("hf_config", "optimizer", "init_seed", "vocab_size")
"""``CausalLMModule`` options a priced recipe may set (its sharing options and a model given whole are not priced)."""
CAUSAL_LM_DEFAULTS = {"litgpt_config": None, "model": None, "parts": None, "num_unique_blocks": None,
                      "sharing": "sequence", "pseudo_depth": "shared", "growth_init": "copy"}
"""The other options at the values that change nothing priced (a run's saved config.yaml spells them all out)."""


def hf_config_of(model: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The ``hf_config`` of a recipe whose model is ``CausalLMModule`` built from a Hugging Face config (None for
    any other model). A pseudo model (``num_unique_blocks``) or a litgpt or whole model is refused: the cost model
    prices the Hugging Face families of ``hf_decoder.PRICED_FAMILIES``, every layer its own block."""
    if not isinstance(model, dict) or str(model.get("class_path", "")).rsplit(".", 1)[-1] != "CausalLMModule":
        return None
    options = model.get("init_args") or {}
    hf_config = options.get("hf_config")
    unpriced = sorted(name for name, value in options.items()
                      if name not in CAUSAL_LM_PRICED and CAUSAL_LM_DEFAULTS.get(name, object()) != value)
    if not isinstance(hf_config, dict) or unpriced:
        what = (f"model.init_args.{unpriced[0]}" if unpriced and isinstance(hf_config, dict)
                else "a model without hf_config")
        raise ValueError(
            f"{path}: `lightning-p2r plan` prices CausalLMModule built from a Hugging Face hf_config whose layers are "
            f"each their own block; {what} is not priced. Time such a model's layouts with `lightning-p2r fit "
            "--config RECIPE --trainer.max_steps 20` and its logged perf/tokens_per_s (docs/planning.md, \"Hugging "
            "Face decoders\")")
    return dict(hf_config)


def m6_config_of(model: dict[str, Any], path: Path) -> dict[str, Any]:
    """The ``M6Config`` fields of a recipe's ``model`` section: ``model.config``, or, where the recipe names its
    class (``class_path: lightning_p2r.M6LanguageModel``), ``model.init_args.config``. Another model class is refused:
    the cost model counts the M6 model's layers, and pricing the M6 defaults in its place would be silently wrong."""
    if not isinstance(model, dict):
        raise ValueError(f"{path}: model must be a mapping, got {model!r}")
    class_path = model.get("class_path")
    if class_path is None:
        options = model
    elif str(class_path).rsplit(".", 1)[-1] == "M6LanguageModel":
        options = model.get("init_args") or {}
    else:
        hf = ((model.get("init_args") or {}).get("hf_config") or {}).get("model_type")
        described = f"{class_path} (a Hugging Face {hf})" if hf else str(class_path)
        raise ValueError(
            f"{path}: model.class_path is {described}, and `lightning-p2r plan` prices the package's M6 model and "
            "CausalLMModule built from a Hugging Face hf_config (docs/planning.md, \"Hugging Face decoders\"); it has "
            "no cost model for this model's layers, and pricing another model in its place would mislead. Time this "
            "model's layouts with `lightning-p2r fit --config RECIPE --trainer.max_steps 20` and its logged "
            "perf/tokens_per_s (docs/planning.md, \"Hugging Face decoders\")")
    unknown = sorted(set(options) - set(M6_MODULE_OPTIONS))
    if unknown:
        where = "model.init_args" if class_path is not None else "model"
        raise ValueError(f"{path}: {where}.{unknown[0]} is not an option of M6LanguageModel (it takes "
                         f"{', '.join(M6_MODULE_OPTIONS)})")
    return options.get("config") or {}


PRICED_PRECISIONS = {"32-true": "32-true", "32": "32-true", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
                     "16-mixed": "bf16-mixed", "16": "bf16-mixed", "bf16-true": "bf16-true", "16-true": "bf16-true"}
"""Lightning's ``trainer.precision`` values and the precision each is priced at: fp16 moves and stores as many bytes
as bf16 (its loss scaling is not priced)."""


def priced_precision(value: str, path: Path | None = None) -> str:
    """The ``Workload.precision`` a recipe's ``trainer.precision`` is priced at; one the cost model has no widths
    for (64-true, transformer-engine, ...) is refused, naming ``--precision``."""
    priced = PRICED_PRECISIONS.get(str(value))
    if priced is None:
        where = f"{path}: " if path is not None else ""
        raise ValueError(f"{where}trainer.precision={value!r} is not priced (the planner knows "
                         f"{', '.join(sorted(PRICED_PRECISIONS))}); pass --precision 32-true, bf16-mixed or bf16-true "
                         "to price the run at one of those")
    return priced


def workload_for(settings: dict[str, Any], args: argparse.Namespace, path: Path | None = None) -> Workload:
    # --precision takes the recipe's spellings (choices: PRICED_PRECISIONS), priced the same way.
    precision = priced_precision(args.precision or settings["precision"], path)
    global_batch = args.global_batch or settings["batch_size"] * settings["data_ranks"] * settings["accumulate"]
    return Workload(global_batch=global_batch, seq_len=args.seq_len or settings["seq_len"], precision=precision)


def strategy_fragment(plan: Plan, workload: Workload, cluster: Cluster) -> str:
    """The recipe lines that run ``plan``'s layout on ``cluster``."""
    layout = plan.layout
    options = layout.strategy_options()
    per_node = min(cluster.devices, cluster.devices_per_node)
    lines = ["trainer:", f"  devices: {per_node}", f"  num_nodes: {max(1, cluster.devices // per_node)}",
             "  strategy:", "    class_path: lightning_p2r.P2RStrategy", "    init_args:" + ("" if options else " {}")]
    lines += [f"      {key}: {_yaml_value(value)}" for key, value in options.items()]
    per_rank = workload.global_batch // layout.data_parallel(cluster.devices)
    if layout.trainer_accumulation > 1:
        lines.append(f"  accumulate_grad_batches: {layout.trainer_accumulation}")
        per_rank //= layout.trainer_accumulation
    lines += ["data:", f"  batch_size: {per_rank}  # per data-parallel rank", f"  seq_len: {workload.seq_len}"]
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def plan_rows(config: PricedModel, plans: list[Plan], workload: Workload, pseudo: PricedModel | None,
              cluster: Cluster) -> list[dict[str, Any]]:
    """One printed row per plan. With a calibrated file's ``fitted_spread``, ``step_low_s`` / ``step_high_s``: the
    step with every fitted term at the low and at the high end of its leave-one-out range
    (:func:`fitted_step_range`)."""
    rows = []
    for rank, plan in enumerate(plans, 1):
        step, memory = plan.step, plan.memory
        row = {"rank": rank, "layout": plan.layout.describe(), "tokens_per_s": plan.tokens_per_second(workload),
               "step_s": step.total}
        if cluster.fitted_spread:
            row["step_low_s"], row["step_high_s"] = fitted_step_range(config, plan.layout, cluster, workload,
                                                                            step.total)
        row |= {f"{k}_s": v for k, v in step.as_dict().items() if k != "total"}
        row |= {"device_GB": memory.device_total / GB, "states_GB": memory.model_states / GB,
                "activations_GB": memory.activations / GB, "host_GB": memory.host / GB}
        if pseudo is not None:
            try:
                row["pseudo_step_s"] = evaluate(pseudo, plan.layout, cluster, workload).step.total
            except ValueError:  # the pseudo model cannot run this layout (a block shared by two local stages)
                row["pseudo_step_s"] = "-"
        rows.append(row)
    return rows


def _format(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def format_rows(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_format(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _names(text: str | None, allowed: tuple[str, ...], option: str, parser: argparse.ArgumentParser
           ) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        parser.error(f"{option}: {bad or text!r} not among {list(allowed)}")
    return names


def _numbers(text: str | None, kind: type, option: str, parser: argparse.ArgumentParser) -> tuple | None:
    if text is None:
        return None
    try:
        values = tuple(kind(n) for n in text.split(",") if n.strip())
    except ValueError:
        parser.error(f"{option}: expected comma-separated numbers, got {text!r}")
    # Offload fractions are shares of the blocks; micro-batch counts whole numbers of batches.
    low, high = (0.0, 1.0) if kind is float else (1, None)
    if not values:
        parser.error(f"{option}: expected comma-separated numbers, got {text!r}")
    bad = [value for value in values if value < low or (high is not None and value > high)]
    if bad:
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        parser.error(f"{option}: each value must be {allowed}, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-p2r plan", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--cluster", required=True, nargs="+",
                        help="cluster YAML (lightning-p2r calibrate writes one); several: the one calibrated for "
                             "--devices processes prices the run")
    parser.add_argument("-c", "--config", required=True, help="a recipe YAML: its model.config, data and trainer")
    parser.add_argument("--devices", type=int, help="devices in the run (default: the cluster file's)")
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the recipe's)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the recipe's data.seq_len)")
    parser.add_argument("--precision", choices=list(PRICED_PRECISIONS), metavar="PRECISION",
                        help=f"one of {', '.join(PRICED_PRECISIONS)}, as trainer.precision takes them (default: the "
                             "recipe's); 16-mixed, 16 and bf16 are priced as bf16-mixed, 16-true as bf16-true, 32 as "
                             "32-true")
    parser.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    parser.add_argument("--sharding", help=f"comma-separated subset of {list(SHARDINGS)}")
    parser.add_argument("--schedules", help=f"comma-separated subset of {list(SCHEDULES)}")
    parser.add_argument("--offload-fractions", help="comma-separated fractions to try (default 0,0.25,0.5,1)")
    parser.add_argument("--micro-batches", help="comma-separated counts to try (default: every divisor)")
    parser.add_argument("--memory-headroom", type=float, default=0.9,
                        help="share of device memory a plan may fill (default 0.9)")
    parser.add_argument("--csv", help="also write every fitting layout's row to this CSV file")
    parser.add_argument("--trial", type=int, metavar="K",
                        help="then run the K best layouts on this machine for a few steps (random tokens, no "
                             "checkpoint), print measured beside predicted and recommend the measured best")
    parser.add_argument("--trial-steps", type=int,
                        help=f"optimizer steps per trial, the first 2 untimed (default {TRIAL_STEPS}: with 6, the "
                             "same layout's median step varied 1.7x between runs on a 2-core machine, with 20 by 1.2x)")
    parser.add_argument("--no-speed-check", action="store_true",
                        help="price with the cluster file as it is, without timing its reference step again (by "
                             "default a file calibrated on this machine is re-timed, under a second, and every "
                             "step priced at the machine's present speed)")
    parser.add_argument("--trial-rounds", type=int, metavar="R",
                        help="run the K layouts in turn R times and compare each one's median (default 1): a "
                             "machine that drifts between runs then slows every layout alike")
    return parser


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value in (("--global-batch", args.global_batch), ("--seq-len", args.seq_len),
                        ("--devices", args.devices)):
        if value is not None and value < 1:  # (--global-batch 0 once meant "the recipe's", silently)
            parser.error(f"{flag} must be >= 1, got {value}")
    try:
        cluster, mismatch = cluster_for([load_cluster(path) for path in args.cluster], args.devices)
        config, settings = recipe_inputs(args.config)
        if mismatch:
            print(f"warning: {mismatch}")
        workload = workload_for(settings, args, args.config)
        if isinstance(config, HFDecoder):
            if config.position_embedding == "learned" and workload.seq_len > config.max_seq_len:
                raise ValueError(f"sequences of {workload.seq_len} tokens exceed the {config.max_seq_len} learned "
                                 f"positions of this {config.model_type} (its n_positions)")
        else:
            config = dataclasses.replace(config, max_seq_len=workload.seq_len)  # --seq-len, linked as fit links it
    except ValueError as error:
        parser.error(str(error))
    if args.top < 1 or not 0 < args.memory_headroom <= 1:
        parser.error("--top must be >= 1 and --memory-headroom in (0, 1]")
    accelerator = "cpu"
    given = [flag for flag, value in (("--trial-steps", args.trial_steps), ("--trial-rounds", args.trial_rounds))
             if value is not None]
    if given and args.trial is None:  # they only shape trials: alone they would be ignored without a word
        verb = "apply" if len(given) > 1 else "applies"
        parser.error(f"{' and '.join(given)} {verb} only to trials: add --trial K (the number of best layouts to run)")
    args.trial_steps = TRIAL_STEPS if args.trial_steps is None else args.trial_steps
    args.trial_rounds = 1 if args.trial_rounds is None else args.trial_rounds
    if args.trial is not None:
        from ..measure.trial import machine_devices, trial_refusal

        accelerator, available = machine_devices()
        refusal = trial_refusal(args.trial, cluster.devices, accelerator, available)
        if refusal is None and args.trial_steps < 3:
            refusal = f"--trial-steps must be >= 3 (2 warm-up steps, then timed ones), got {args.trial_steps}"
        if refusal is None and args.trial_rounds < 1:
            refusal = f"--trial-rounds must be >= 1 (how often each layout runs), got {args.trial_rounds}"
        if refusal:
            parser.error(refusal)
    if not args.no_speed_check:
        cluster = _at_present_speed(cluster)
    space = SearchSpace()
    changes = {"shardings": _names(args.sharding, SHARDINGS, "--sharding", parser),
               "schedules": _names(args.schedules, SCHEDULES, "--schedules", parser),
               "offload_fractions": _numbers(args.offload_fractions, float, "--offload-fractions", parser),
               "micro_batch_counts": _numbers(args.micro_batches, int, "--micro-batches", parser)}
    space = dataclasses.replace(space, **{k: v for k, v in changes.items() if v is not None})
    plans, priced = search(config, cluster, workload, space, memory_headroom=args.memory_headroom)
    print(f"cluster {cluster.name}: {cluster.devices} devices ({cluster.devices_per_node} per node), "
          f"{cluster.device_memory / GB:.1f} GB each; model: {_describe_model(config)}; "
          f"global batch {workload.global_batch} x {workload.seq_len} tokens, {workload.precision}")
    print(f"{priced} valid layouts priced, {len(plans)} fit (ZeRO stages listed once where one data-parallel rank "
          "leaves them nothing to shard)")
    if not priced:  # nothing to fit: the options leave no layout the strategy runs (micro-batches 3 of a batch of 16)
        raise SystemExit(f"no valid layout: each --micro-batches count must divide a data rank's share of the batch of "
                         f"{workload.global_batch}, and the parallel degrees the devices and the model; widen "
                         "--micro-batches, --sharding or --schedules")
    own_layout = recipe_layout_line(config, settings, plans, cluster, workload, args.memory_headroom)
    if not plans:
        print(own_layout)
        raise SystemExit("no layout fits: add devices, memory, offload fractions up to 1, or lower the batch")
    pseudo = pseudo_of(config) if config.num_blocks == config.num_layers and isinstance(config, M6Config) else None
    rows = plan_rows(config, plans[: args.top], workload, pseudo, cluster)
    spread = ["step_low_s", "step_high_s"] if cluster.fitted_spread else []
    columns = ["rank", "layout", "tokens_per_s", "step_s", *spread, "compute_s", "bubble_s", "tensor_parallel_s",
               "expert_parallel_s", "pipeline_sends_s", "data_parallel_s", "offload_copies_s", "optimizer_s",
               "device_GB", "states_GB", "activations_GB", "host_GB"] + (["pseudo_step_s"] if pseudo else [])
    print(format_rows(rows, columns))
    _warn_missing_terms(config, [p.layout for p in plans[: args.top]], cluster, workload)
    print(own_layout)
    print("\nall figures are predictions of the cost model (docs/planning.md); the best layout as a recipe fragment:")
    print(strategy_fragment(plans[0], workload, cluster))
    if args.trial is not None:
        trial(config, plans[: args.trial], workload, cluster, args.trial_steps, accelerator, args.trial_rounds)
    if args.csv:
        every = plan_rows(config, plans, workload, None, cluster)
        with open(args.csv, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=columns[:-1] if pseudo else columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(every)


def _at_present_speed(cluster: Cluster) -> Cluster:
    """``cluster`` priced at this machine's present speed (``lightning_p2r.measure.speed``), saying how far it moved;
    as it is where the file has no reference step or describes another machine."""
    from ..measure.speed import present_speed

    ratio, line = present_speed(cluster)
    if line:
        print(line)
    return cluster if ratio is None else at_speed(cluster, ratio)


def _warn_hugging_face_terms(config: HFDecoder, cluster: Cluster) -> None:
    """What a Hugging Face model's prices lack: its family's layers timed (an older file prices them from M6's by
    their operators)."""
    if cluster.dense_layer_overhead > 0 and not cluster.hf_layer_overheads:
        print(f"warning: {cluster.name} has no hf_layer_overheads (measured by `lightning-p2r calibrate` with "
              f"transformers installed, from 2026-12-01): this {config.model_type}'s layers are priced from the M6 "
              "layer's costs by their operators, which came out 11-38% long on one CPU process; calibrate again")


def _warn_missing_terms(config: PricedModel, layouts: list[Layout], cluster: Cluster, workload: Workload) -> None:
    """Say which framework terms the shown layouts count but the cluster file leaves at zero (their predictions are
    short by that time), and where each comes from; whether attention is priced by shape; whether a CPU file has
    the layer costs that grow with the tokens and the experts' weights; whether it prices the dropout of a model that
    drops; and whether a pipeline's recompute is priced by measured checkpoint costs."""
    for name, count in missing_terms(config, layouts, cluster, workload).items():
        print(f"warning: {cluster.name} has no {name} ({HOW_TO_GET[name]}): {count} of the {len(layouts)} layouts "
              "shown count it, and their step times leave it out")
    if isinstance(config, HFDecoder):
        _warn_hugging_face_terms(config, cluster)
    if not cluster.attention_rates:
        print(f"warning: {cluster.name} has no attention_rates (measured by `lightning-p2r calibrate`): attention is "
              f"priced at attention_flops, measured at one shape, for this model's heads of {config.head_dim} and "
              f"{workload.seq_len} tokens too; small heads and short sequences attend slower and come out short")
    if cluster.accelerator == "cpu" and cluster.dense_layer_overhead > 0 and not any(
            getattr(cluster, name) for name in SIZE_DEPENDENT_LAYER_COSTS):
        print(f"warning: {cluster.name} has no per-token layer costs ({', '.join(SIZE_DEPENDENT_LAYER_COSTS)}; "
              "measured by `lightning-p2r calibrate` from 2026-11-28): a layer's per-token work beyond its traffic and "
              "each expert's gradient stacking are left out, and CPU steps come out short (by 20-30% on the draws in "
              "docs/benchmarks.md); calibrate again")
    drops = any(layer_dropout_elements(config, workload.seq_len)) or embedding_dropout_elements(config) > 0
    if drops and not (cluster.dropout_element_overhead or cluster.attention_dropout_element_overhead):
        print(f"warning: {cluster.name} has no dropout costs (dropout_element_overhead, "
              "attention_dropout_element_overhead; measured by `lightning-p2r calibrate` from 2026-12-01) and this "
              "model drops in training: its masks are left out (GPT-2's default dropout made its layers about twice "
              "their price on a CPU); calibrate again")
    checkpointed = sum(layout.recompute and layout.pipeline_parallel > 1 for layout in layouts)
    if checkpointed and cluster.dense_layer_overhead > 0 and cluster.dense_checkpoint_overhead <= 0:
        print(f"warning: {cluster.name} has no checkpoint costs (dense_checkpoint_overhead, moe_checkpoint_overhead, "
              "moe_expert_checkpoint_overhead; measured by `lightning-p2r calibrate` from 2026-11-30): "
              f"{checkpointed} of the {len(layouts)} layouts shown recompute in a pipeline, priced as one more "
              "forward, where checkpointing each layer costs about twice that on a CPU; calibrate again")



def trial(config: PricedModel, plans: list[Plan], workload: Workload, cluster: Cluster, steps: int,
          accelerator: str, rounds: int = 1) -> list[dict[str, Any]]:
    """Run ``plans`` on this machine (``lightning_p2r.measure.trial``), print measured beside predicted and the
    measured best as a recipe fragment; returns the rows."""
    from ..measure.trial import run_trials

    turns = f", in turn {rounds} times (the median counts)" if rounds > 1 else ""
    print(f"\ntrials: the {len(plans)} best layouts, {steps} optimizer steps each on {cluster.devices} "
          f"{accelerator} process(es), random tokens{turns}")
    rows = run_trials(config, [(p.layout, p.step.total) for p in plans], workload, devices=cluster.devices,
                      steps=steps, accelerator=accelerator, rounds=rounds)
    spread = ["measured_min_s", "measured_max_s"] if rounds > 1 else []
    print(format_rows(rows, ["rank", "layout", "predicted_s", "measured_s", *spread, "error_pct", "load_avg_1m"]))
    best = min(range(len(rows)), key=lambda i: rows[i]["measured_s"])
    print(f"\nmeasured best: rank {rows[best]['rank']} ({rows[best]['layout']}, {rows[best]['measured_s']:.4g} s "
          "per step); timings on a shared machine are noisy (load_avg_1m): as a recipe fragment:")
    print(strategy_fragment(plans[best], workload, cluster))
    return rows


def _describe_model(config: PricedModel) -> str:
    kind = config.describe() if isinstance(config, HFDecoder) else (
        "pseudo" if config.num_blocks < config.num_layers else "real")
    moe = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    experts = f"{config.num_experts} experts in {moe} MoE layers" if moe else "dense"
    return (f"{parameter_count(config) / 1e6:,.1f}M parameters ({kind}), {config.num_layers} layers, dim "
            f"{config.dim}, {experts}")


def layout_from_options(options: dict[str, Any]) -> Layout:
    """A :class:`Layout` from ``P2RStrategy`` keywords (those the planner does not price are ignored)."""
    known = {f.name for f in dataclasses.fields(Layout)}
    values = {k: v for k, v in options.items() if k in known}
    if values.get("offload_fraction") is None:
        values["offload_fraction"] = 0.0
    if values.get("offload_blocks") is not None:
        values["offload_blocks"] = tuple(values["offload_blocks"])
    return Layout(**values)
