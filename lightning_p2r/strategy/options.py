"""``P2RStrategy``'s flat keywords as typed, frozen sections, each validated once, when it is built, and read back as
``strategy.sharding`` and so on. Each option is declared here once: its name, type, default and docstring. The
constructor's keywords are generated from these fields (:func:`constructor_keywords`, written into strategy.py by
``python -m lightning_p2r.cli.docs``), and ``docs/configuration.md`` and the strategy's ``--help`` text from their
docstrings (the docs/*.md pages explain each option at length). To add an option: a field with its docstring in its
section, then that command.
"""

from __future__ import annotations

import ast
import builtins
import collections.abc
import inspect
import numbers
import textwrap
import types
import typing
from dataclasses import InitVar, dataclass, fields
from typing import Literal

from ..layout import (
    SHARDINGS,
    Accumulation,
    Layout,
    OffloadState,
    PipelineSchedule,
    Sharding,
    check_accumulation_options,
    check_bool,
    check_compile_option,
    check_offload_options,
    check_parallel_options,
)
from .host_allocator import HostAllocator, check_host_allocator


@dataclass(frozen=True)
class ShardingConfig:
    """How model states are split across the data-parallel ranks (ZeRO)."""

    sharding: Sharding = "none"
    """"none" (replicated: every rank holds everything, gradients all-reduced, as DDP), "zero1" (optimizer states
    sharded), "zero2" (+ gradients) or "zero3" (+ parameters), all on FSDP2 across processes. On one process
    "zero2"/"zero3" still run FSDP2 (a group of one), so checkpoints and layouts match a larger run."""

    count_collectives: bool = False
    """Record each optimizer step's collectives (calls and bytes per kind) in ``strategy.collectives``, to measure."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"P2RStrategy.sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        check_bool("count_collectives", self.count_collectives)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model itself is split across ranks; the remaining ranks are data parallel, with ``sharding``."""

    tensor_parallel: int = 1
    """Ranks that split each layer: attention by heads, FFNs and experts by hidden units, embedding and output by
    vocabulary (Megatron-LM). Must divide the number of processes, ``num_heads`` and ``vocab_size``."""

    expert_parallel: int = 1
    """Ranks that split the experts of each MoE layer (tokens reach them by all-to-all), borrowed from the data
    ranks: must divide processes / tensor_parallel, and ``num_experts``."""

    sequence_parallel: bool = False
    """With tensor_parallel > 1: keep the activations between layers split by sequence position (Megatron-LM), which
    divides their memory by tensor_parallel. Needs rotary positions and sequence lengths divisible by it."""

    pipeline_parallel: int = 1
    """Ranks that split the model by depth into stages of whole layers (Lamy-Poirier's modular pipeline, run by
    ``torch.distributed.pipelining``; embedding in the first stage, head in the last); must divide the processes."""

    pipeline_schedule: PipelineSchedule = "1f1b"
    """With pipeline_parallel > 1: "gpipe" or "1f1b" with one stage per rank, "interleaved_1f1b" with several, or
    "looped_bfs" (breadth-first, any number: a stage is fetched once per direction per step)."""

    stages_per_rank: int = 1
    """Stages each pipeline rank holds, looped (rank r holds stages r, r + p, ...), which shrinks the bubble to
    (p - 1) / (stages_per_rank * micro_batches + p - 1); ``num_layers`` must divide into p * stages_per_rank."""

    def __post_init__(self) -> None:
        check_parallel_options(Layout(**{f.name: getattr(self, f.name) for f in fields(self)}))


@dataclass(frozen=True)
class AccumulationConfig:
    """How the micro-batches of one optimizer step are scheduled."""

    accumulation: Accumulation = "standard"
    """"standard" (depth-first, Lightning's) or "layered" (breadth-first: each offloaded or sharded block is fetched
    and its gradient reduced once per optimizer step)."""

    micro_batches: int = 1
    """Layered accumulation, or pipeline_parallel > 1: the micro-batches each training batch is split into (the batch
    size must divide; Lightning's ``accumulate_grad_batches`` must then be 1, which standard accumulation uses)."""

    recompute: bool = False
    """Layered accumulation, or pipeline_parallel > 1: keep each layer's input, recompute its interior in backward."""

    compile: bool | str = False
    """torch.compile each block's forward: True uses the default backend ("inductor"), a string names another
    ("aot_eager"); a layout that cannot compile is refused with the reason."""

    reduce_every_micro_batch: bool = False
    """Standard accumulation on FSDP2: reduce(-scatter) the gradients after every micro-batch (ZeRO-2's memory, more
    reductions) rather than once after the last, as DDP's ``no_sync`` would (offloaded units always do)."""

    pipelined: InitVar[bool] = False
    """Whether pipeline_parallel > 1 (set by the strategy): micro_batches is then the pipeline's."""

    def __post_init__(self, pipelined: bool) -> None:
        check_accumulation_options(self.accumulation, self.micro_batches, self.recompute, pipelined=pipelined)
        check_compile_option(self.compile)
        check_bool("reduce_every_micro_batch", self.reduce_every_micro_batch)


@dataclass(frozen=True)
class OffloadConfig:
    """Which blocks live in host memory (granular offload, M6-10T) and how they stream. Give at most one of
    ``offload_fraction``, ``offload_blocks`` and ``device_memory_budget``; none keeps every block on the device."""

    offload_fraction: float | None = None
    """Share of the blocks kept in host memory, spread evenly through the depth."""

    offload_blocks: list[int] | None = None
    """Explicit block indices to keep in host memory."""

    device_memory_budget: int | float | str | None = None
    """Device bytes for model states ("12GB", "512MiB", "80%" of the device); as many blocks as fit stay resident."""

    activation_allowance: int | float | str = 0
    """Bytes (or a size string such as "2GB", not a percentage) that device_memory_budget reserves for activations;
    refused without a budget, where it would do nothing."""

    offload_states: list[OffloadState] | None = None
    """What offloaded blocks keep on the host: always "grads" and "optimizer" (their optimizer step runs on the
    host), and "params" unless the parameters should stay resident on the device. None means all three."""

    prefetch: int = 1
    """Offloaded blocks copied in ahead of use (in forward and in backward order)."""

    pin_memory: bool | Literal["auto"] = "auto"
    """Page-locked host buffers for asynchronous copies; "auto" pins only when an accelerator exists."""

    overlap_host_step: bool | Literal["auto"] = "auto"
    """Run an offloaded block's host optimizer step while the device computes earlier blocks' backward, only where it
    cannot change the result (no clipping, gradient scaler or accumulation); "auto": only with an accelerator (on a
    CPU the two compete for the cores: 476 ms instead of 345 ms per step measured on 2 cores)."""

    host_step: Literal["exact", "delayed"] = "exact"
    """"exact": an offloaded block's host optimizer update is in place before the next forward. "delayed" (one process,
    DeepSpeed's delayed parameter update): the update from step t's gradients is computed on the host while the
    device runs step t+1 and used from step t+2, so the host step hides behind the device when it is the shorter of
    the two (a delayed step is never shorter than its host step: docs/offload.md); those blocks then train one step
    stale (docs/offload.md measures the cost). Clipping, loss scaling and checkpoints stay exact."""

    log_telemetry: bool = True
    """Log the offload statistics (``offload/*``) through the Trainer's loggers."""

    host_allocator: HostAllocator = "auto"
    """"retain": each training process keeps the host memory it frees for reuse (glibc's mmap and trim thresholds
    raised), so a step does not map and fault in again what the last one gave back; "system": the C library's
    defaults; "auto": retain when training on the CPU, whose activations are host memory (the quickstart recipe's
    model on one process: 97 ms a step instead of 107 on a 2-vCPU EPYC). Left alone where ``LD_PRELOAD`` or a
    ``MALLOC_*_`` variable already chooses (docs/performance.md)."""

    def __post_init__(self) -> None:
        states = check_offload_options(
            offload_fraction=self.offload_fraction, offload_blocks=self.offload_blocks,
            device_memory_budget=self.device_memory_budget, offload_states=self.offload_states,
            prefetch=self.prefetch, pin_memory=self.pin_memory, overlap_host_step=self.overlap_host_step,
            host_step=self.host_step, activation_allowance=self.activation_allowance)
        # Stored resolved (all three by default), sorted so equal settings compare equal.
        object.__setattr__(self, "offload_states", sorted(states))
        check_bool("log_telemetry", self.log_telemetry)
        check_host_allocator(self.host_allocator)


@dataclass(frozen=True)
class ModelConfig:
    """What the strategy is told about the model, where it cannot tell by itself (docs/your_model.md)."""

    blocks: str | None = None
    """Dotted path from the LightningModule to the model's block list (an ``nn.ModuleList``), e.g.
    "model.model.layers" for a Hugging Face causal LM held as ``self.model``. None: a model that declares ``blocks``
    and ``layer_to_block`` itself (``protocols.BlockSequence``), else the longest list of modules of one class,
    logged at setup."""

    def __post_init__(self) -> None:
        if self.blocks is not None and (not isinstance(self.blocks, str)
                                        or not all(part.isidentifier() or part.isdigit()
                                                   for part in self.blocks.split("."))):
            raise ValueError(f"P2RStrategy.blocks must be a dotted module path such as 'model.model.layers', "
                             f"got {self.blocks!r}")


def layout_of(sharding: ShardingConfig, parallel: ParallelConfig, accumulation: AccumulationConfig,
               offload: OffloadConfig) -> Layout:
    """The rulebook's :class:`~lightning_p2r.layout.Layout` of these sections."""
    values = {"sharding": sharding.sharding, "offload_fraction": offload.offload_fraction or 0.0,
              "offload_blocks": tuple(offload.offload_blocks) if offload.offload_blocks else None,
              "device_memory_budget": offload.device_memory_budget}
    for section in (parallel, accumulation):
        values |= {f.name: getattr(section, f.name) for f in fields(section)}
    return Layout(**values)


SECTIONS: dict[str, type] = {"sharding_config": ShardingConfig, "parallel_config": ParallelConfig,
                             "accumulation_config": AccumulationConfig, "offload_config": OffloadConfig,
                             "model_config": ModelConfig}
"""The strategy's attribute holding each section."""


OPTION_NAMES: tuple[str, ...] = tuple(f.name for cls in SECTIONS.values() for f in fields(cls))
"""Every option ``P2RStrategy`` takes, in the sections' order: the constructor's keywords (generated from them)."""


def build_sections(options: dict[str, object]) -> dict[str, object]:
    """Each section (by its strategy attribute) built from the flat keyword values, each validated as it is built,
    then each value against its field's type (:func:`check_field_types`: what the section's checks let through, or
    the option whose type broke one of them)."""
    built: dict[str, object] = {}
    for attribute, cls in SECTIONS.items():
        values = {f.name: options[f.name] for f in fields(cls)}
        given = dict(values)
        if cls is AccumulationConfig:  # micro_batches means the pipeline's when there is one
            values["pipelined"] = options["pipeline_parallel"] > 1  # type: ignore[operator]
        try:
            built[attribute] = cls(**values)
        except TypeError:
            check_field_types(cls, given)
            raise
        check_field_types(cls, given)
    return built


def check_field_types(cls: type, values: dict[str, object]) -> None:
    """Refuse a value of another type than its field's annotation, naming the option and the type: a string where a
    number belongs used to fail inside a comparison (``offload_fraction="half"``: "'<=' not supported"), and a bool
    passed as a number (``offload_fraction=True``) or a float as a count (``prefetch=1.5``) ran as something else.
    A ``Literal`` field takes any value of its literals' type here; its section then names the allowed ones."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints and not _matches(value, hints[name]):
            raise ValueError(f"P2RStrategy.{name} must be {_describe(hints[name])}, got {value!r} "
                             f"({type(value).__name__})")


def _matches(value: object, hint: object) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint in (str, type(None)):
        return isinstance(value, hint)  # type: ignore[arg-type]
    if origin is Literal:
        return any(type(value) is type(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is list:  # any sequence of such items (a tuple, a range) but a string
        return (isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes))
                and all(_matches(item, args[0]) for item in value))
    return True  # a type this check does not know: the section's own validation judges it


def _describe(hint: object) -> str:
    """``hint`` in words: "a number or None", "True, False or 'auto'", "one of ['none', 'zero1']"."""
    if typing.get_origin(hint) is Literal:
        return f"one of {list(typing.get_args(hint))}"
    choices = _choices(hint)
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def _choices(hint: object) -> list[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    names = {bool: ["True", "False"], int: ["an integer"], float: ["a number"], str: ["a string"],
             type(None): ["None"]}
    if hint in names:
        return names[hint]  # type: ignore[index]
    if origin is Literal:
        return [repr(arg) for arg in args]
    if origin in (typing.Union, types.UnionType):
        return [choice for arg in args for choice in _choices(arg)]
    if origin is list:
        return [f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s"]
    return [str(hint)]


GENERATED_BEGIN = "# ---- options: generated from strategy/options.py by `python -m lightning_p2r.cli.docs` ----"
GENERATED_END = "# ---- end of the generated options ----"


def constructor_keywords(indent: str = "        ") -> str:
    """The option keywords of ``P2RStrategy.__init__`` as source lines (name, annotation and default exactly as the
    sections write them), so each option is declared once, in its section; a static signature stays for
    LightningCLI, IDEs and type checkers. ``tests/unit/test_docs.py`` fails when strategy.py's copy is stale."""
    lines = []
    for cls in SECTIONS.values():
        source = textwrap.dedent(inspect.getsource(cls))
        for statement in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and statement.target.id in OPTION_NAMES):
                annotation = ast.get_source_segment(source, statement.annotation)
                default = ast.get_source_segment(source, statement.value)  # type: ignore[arg-type]
                shadows = "  # noqa: A002 (the option's name, as torch's)" if statement.target.id in vars(
                    builtins) else ""
                lines.append(f"{indent}{statement.target.id}: {annotation} = {default},{shadows}")
    return "\n".join(lines)


def field_docstrings(cls: type) -> dict[str, str]:
    """Map each dataclass field to the string literal written right under it (one line of text)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def args_section() -> str:
    """The ``Args:`` section of ``P2RStrategy``'s docstring, written from the sections' field docstrings (so the
    CLI's ``--help`` and the reference page say the same as the code)."""
    lines = ["Args:"]
    for cls in SECTIONS.values():
        docs = field_docstrings(cls)
        for field in fields(cls):
            wrapped = textwrap.wrap(f"{field.name}: {docs[field.name]}", width=112, break_on_hyphens=False)
            lines.append("    " + wrapped[0])
            lines.extend("        " + line for line in wrapped[1:])
    return "\n".join(lines)
