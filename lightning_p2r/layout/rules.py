"""``Layout`` (the strategy's keywords as one value), the model sizes the rules read, and the checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .mesh import ParallelDims, PlacementPath, Resharding, fsdp_mode_for, placement_path, resharding
from .names import (
    ACCUMULATIONS,
    BREADTH_FIRST,
    PIPELINE_SCHEDULES,
    SHARDINGS,
    SINGLE_STAGE_SCHEDULES,
    check_bool,
    check_compile_option,
    check_degree,
    divisors,
)
from .stages import StageCut, check_local_sharing


@dataclass(frozen=True)
class Layout:
    """One way to run a model: the ``P2RStrategy`` keywords that decide where tensors live and when they move.

    Mirrors the strategy's flat keywords, so a planned layout prints as the recipe fragment that runs it
    (:meth:`strategy_options`), and the strategy's options read back as one (``strategy.layout``).
    """

    sharding: str = "none"
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    stages_per_rank: int = 1
    sequence_parallel: bool = False
    accumulation: str = "standard"
    micro_batches: int = 1
    recompute: bool = False
    compile: bool | str = False
    """True (inductor), False, or a torch.compile backend's name."""
    offload_fraction: float = 0.0
    offload_blocks: tuple[int, ...] | None = None
    """Explicit block indices (in the model) to offload instead of ``offload_fraction``."""
    device_memory_budget: int | str | None = None
    """Offload as many blocks as the budget needs (decided at setup from the model's sizes; the rules read only that
    offload is asked for, the planner prices ``offload_fraction``)."""
    reduce_every_micro_batch: bool = False

    @property
    def pipelined(self) -> bool:
        return self.pipeline_parallel > 1

    @property
    def model_parallel(self) -> bool:
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    @property
    def offloading(self) -> bool:
        """Whether offload is asked for (a zero fraction or an empty block list do not ask)."""
        return bool(self.offload_fraction or self.offload_blocks or self.device_memory_budget is not None)

    def data_parallel(self, devices: int) -> int:
        return devices // (self.tensor_parallel * self.pipeline_parallel)

    def dims(self, devices: int) -> ParallelDims:
        return ParallelDims(devices, self.tensor_parallel, self.expert_parallel, self.pipeline_parallel)

    def sampler_ranks(self, devices: int, rank: int) -> tuple[int, int] | None:
        """(replicas, replica) for the distributed sampler: the ranks of one tensor-parallel group or pipeline read
        the same batch, so the data splits over the data ranks only. None: each rank reads its own share."""
        if self.tensor_parallel * self.pipeline_parallel == 1:
            return None
        dims = self.dims(devices)
        return dims.data_parallel, dims.data_rank(rank)

    def path(self, devices: int) -> PlacementPath:
        return placement_path(self.sharding, devices, offloading=self.offloading,
                              layered=self.accumulation == "layered", model_parallel=self.model_parallel,
                              pipelined=self.pipelined)

    def wraps_blocks(self, devices: int) -> bool:
        """Whether FSDP2 wraps the blocks (and the roots of the parts) on ``devices`` processes: on the "fsdp" and
        "model_parallel" paths, and on a pipeline whose stages have data ranks to shard or replicate over, a model
        split or an offload. A stage alone on its rank with nothing offloaded stays a plain module, as torchtitan
        leaves a pipeline without data parallelism: FSDP2 over a mesh of one rank only adds its hooks per block and
        micro-batch, and a second copy of each parameter while gathered (15-24% of a small model's 2-rank pipeline
        step on CPU, docs/benchmarks.md "Pipeline stages without FSDP2")."""
        path = self.path(devices)
        if path == "pipeline":
            return self.data_parallel(devices) > 1 or self.model_parallel or self.offloading
        return path in ("fsdp", "model_parallel")

    @property
    def resharding(self) -> Resharding:
        """When ZeRO-3's units reshard under this layout (see :class:`~.mesh.Resharding`)."""
        breadth_first = self.pipelined and self.pipeline_schedule in BREADTH_FIRST
        return resharding(fsdp_mode_for(self.sharding),
                          consecutive_micro_batches=self.accumulation == "layered" or breadth_first)

    @property
    def trainer_accumulation(self) -> int:
        """Micro-batches Lightning accumulates (``Trainer(accumulate_grad_batches=...)``): standard accumulation
        without a pipeline is the Trainer's, not the strategy's."""
        plain = self.pipeline_parallel == 1 and self.accumulation == "standard"
        return self.micro_batches if plain else 1

    def strategy_options(self) -> dict[str, Any]:
        """The ``P2RStrategy`` keywords of this layout that differ from the defaults (see ``trainer_accumulation``
        for the micro-batches of standard accumulation)."""
        defaults = Layout()
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(defaults, f.name)}
        if "offload_fraction" in options:
            options["offload_fraction"] = round(self.offload_fraction, 4)
        if "offload_blocks" in options:
            options["offload_blocks"] = list(self.offload_blocks)
        if self.trainer_accumulation > 1:
            options.pop("micro_batches")
        elif self.pipeline_parallel > 1:
            options["micro_batches"] = self.micro_batches
        return options

    def describe(self) -> str:
        parts = [self.sharding]
        for label, value in (("tp", self.tensor_parallel), ("ep", self.expert_parallel),
                             ("pp", self.pipeline_parallel)):
            if value > 1:
                parts.append(f"{label}{value}")
        if self.pipeline_parallel > 1:
            parts.append(self.pipeline_schedule + (f"/v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        if self.sequence_parallel:
            parts.append("sp")
        if self.micro_batches > 1:
            parts.append(f"m{self.micro_batches}")
        if self.accumulation == "layered":
            parts.append("layered")
        if self.recompute:
            parts.append("recompute")
        if self.compile:
            parts.append("compile")
        if self.offload_fraction:
            parts.append(f"offload{self.offload_fraction:g}")
        return " ".join(parts)


@dataclass(frozen=True)
class ModelShape:
    """The model sizes the rules read; None: unknown (a user's model), that rule is not checked."""

    num_layers: int
    layer_to_block: tuple[int, ...] | None = None
    """Which block each layer runs (sharing: several layers, one block)."""
    num_heads: int | None = None
    num_kv_heads: int | None = None
    """Key/value heads where they are fewer than the query heads (grouped-query attention): split by heads too."""
    vocab_size: int | None = None
    hidden_dim: int | None = None
    """The feed-forward (and expert) hidden size tensor parallelism splits."""
    num_experts: int = 0
    moe: bool = False
    """Whether the model has MoE layers (expert parallelism splits their experts)."""
    max_seq_len: int | None = None
    rotary_positions: bool | None = None
    """Whether positions enter per head (rotary), which sequence parallelism needs."""
    shared_experts: bool = False
    """Whether MoE layers' experts still share FFNs (``M6Config.num_unique_experts``, before upcycling)."""
    always_on_experts: int = 0
    """Experts every token runs beside the routed ones (``M6Config.always_on_experts``)."""
    loss_free_balancing: bool = False
    """Whether routing biases move with the observed load (``M6Config.router_balance="bias"``)."""
    owner: str = "the model"
    """Who states the sizes, for messages (``"CausalLMModule.hf_config"``)."""
    fields: tuple[tuple[str, str], ...] = ()
    """(size, the config's own field) where the config names a size otherwise (a Hugging Face config's
    ``num_attention_heads`` for ``num_heads``), so a refusal names the field the user wrote; ``moe_layers``: why it
    has no MoE layers."""

    def field(self, size: str) -> str:
        """The config's name of ``size`` (one of this class's fields)."""
        defaults = {"num_kv_heads": "num_key_value_heads", "moe_layers": "its moe_layers are empty"}
        return dict(self.fields).get(size, defaults.get(size, size))

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From an ``M6Config`` (or anything with its fields)."""
        return cls(num_layers=config.num_layers, layer_to_block=tuple(config.layer_to_block),
                   num_heads=config.num_heads, vocab_size=config.vocab_size,
                   # Both the FFN's and a routed expert's hidden units are split: divisibility must hold for each.
                   hidden_dim=math.gcd(config.hidden_dim, getattr(config, "routed_hidden_dim", config.hidden_dim)),
                   num_experts=config.num_experts, moe=config.moe_layers is None or bool(config.moe_layers),
                   max_seq_len=config.max_seq_len,
                   rotary_positions=config.position_embedding == "rotary",
                   shared_experts=getattr(config, "unique_experts", config.num_experts) < config.num_experts,
                   always_on_experts=getattr(config, "always_on_experts", 0),
                   loss_free_balancing=getattr(config, "router_balance", "aux_loss") == "bias")

    @classmethod
    def of_hf_config(cls, config: Any, owner: str) -> ModelShape:
        """From a Hugging Face config object (its fields read by name, nothing imported): the sizes the strategy
        checks again when it splits the built model (``strategy.parallel.hf_plan``), named as the config names them
        (a GPT-2 config's ``n_head``)."""
        aliases = dict(getattr(config, "attribute_map", {}))  # an alias -> the family's own field

        def label(field: str) -> str:  # the family's field, and the aliases a config dict may give it by
            own = aliases.get(field, field)
            other = sorted(alias for alias, target in aliases.items() if target == own)
            return own + (f" (or {', '.join(other)})" if other else "")

        named = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                 "vocab_size": "vocab_size", "hidden_dim": "intermediate_size", "num_layers": "num_hidden_layers"}
        sizes = {size: getattr(config, field, None) for size, field in named.items()}
        fields = {size: label(field) for size, field in named.items()}
        if sizes["hidden_dim"] is None and getattr(config, "model_type", None) == "gpt2":  # GPT-2's plan splits n_inner
            inner, width = getattr(config, "n_inner", None), getattr(config, "n_embd", None)
            sizes["hidden_dim"], fields["hidden_dim"] = inner or (4 * width if width else None), "n_inner"
        # The routed experts, by the families' names (Mixtral, Qwen-MoE and OLMoE, DeepSeek).
        counted = next(((field, count) for field in ("num_local_experts", "num_experts", "n_routed_experts")
                        if isinstance(count := getattr(config, field, None), int) and count > 0), None)
        if counted is not None:
            fields["num_experts"] = label(counted[0])
        else:
            fields["moe_layers"] = "it sets no num_experts, num_local_experts or n_routed_experts"
        return cls._stated(sizes, fields, counted[1] if counted else 0, owner)

    @classmethod
    def of_litgpt_config(cls, config: Any, owner: str) -> ModelShape:
        """From a litgpt ``Config`` (what ``models.litgpt_plan`` checks again when it splits the built model)."""
        named = {"num_heads": "n_head", "num_kv_heads": "n_query_groups", "vocab_size": "padded_vocab_size",
                 "hidden_dim": "intermediate_size", "num_layers": "n_layer"}
        sizes = {size: getattr(config, field, None) for size, field in named.items()}
        experts = getattr(config, "n_expert", 0) if getattr(config, "mlp_class_name", None) == "LLaMAMoE" else 0
        fields = named | {"num_experts": "n_expert", "moe_layers": "its mlp_class_name is not 'LLaMAMoE'"}
        return cls._stated(sizes, fields, experts or 0, owner)

    @classmethod
    def _stated(cls, sizes: dict[str, Any], fields: dict[str, str], num_experts: int, owner: str) -> ModelShape:
        known = {size: value for size, value in sizes.items() if isinstance(value, int) and not isinstance(value, bool)}
        return cls(num_layers=known.pop("num_layers", 0), **known, num_experts=num_experts, moe=num_experts > 0,
                   owner=owner, fields=tuple(sorted(fields.items())))


def check_parallel_options(layout: Layout) -> None:
    """The parallel degrees, the schedule against the stages per rank, sequence parallelism's prerequisite."""
    check_bool("sequence_parallel", layout.sequence_parallel)
    if layout.sequence_parallel and layout.tensor_parallel == 1:
        raise ValueError("P2RStrategy(sequence_parallel=True) splits activations over the tensor-parallel ranks: "
                         "set tensor_parallel > 1 as well")
    for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "stages_per_rank"):
        check_degree(name, getattr(layout, name))
    schedule, v = layout.pipeline_schedule, layout.stages_per_rank
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"P2RStrategy.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if v > 1 and schedule in SINGLE_STAGE_SCHEDULES:
        raise ValueError(
            f"P2RStrategy(pipeline_schedule={schedule!r}) runs one stage per rank, got stages_per_rank={v}: use "
            "pipeline_schedule='looped_bfs' or 'interleaved_1f1b' for looped stages")
    if v == 1 and schedule == "interleaved_1f1b":
        raise ValueError("P2RStrategy(pipeline_schedule='interleaved_1f1b') interleaves several stages per rank: set "
                         "stages_per_rank > 1, or use pipeline_schedule='1f1b' for one stage per rank")
    if v > 1 and layout.pipeline_parallel == 1:
        raise ValueError(f"P2RStrategy(stages_per_rank={v}) loops stages over pipeline ranks: set "
                         "pipeline_parallel > 1 as well")


def check_accumulation_options(accumulation: str, micro_batches: int, recompute: bool, *,
                               pipelined: bool = False) -> None:
    """The micro-batch schedule. ``pipelined``: pipeline parallelism is on, ``micro_batches`` counts the pipeline's
    micro-batches (:func:`check_micro_batches` checks them against its degree and schedule)."""
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"P2RStrategy.accumulation must be 'standard' or 'layered', got {accumulation!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"P2RStrategy.micro_batches must be an integer >= 1, got {micro_batches!r}")
    if recompute and accumulation != "layered" and not pipelined:
        raise ValueError("P2RStrategy.recompute applies to accumulation='layered' only")
    if micro_batches > 1 and accumulation != "layered" and not pipelined:
        raise ValueError("P2RStrategy.micro_batches applies to accumulation='layered' (or to pipeline_parallel > 1); "
                         "for standard (depth-first) accumulation use Trainer(accumulate_grad_batches=...)")
    check_bool("recompute", recompute)


def check_micro_batches(schedule: str, micro_batches: int, pipeline_parallel: int) -> None:
    """Enough micro-batches to fill the pipeline (and, interleaved, whole rounds of them)."""
    if micro_batches < pipeline_parallel:
        raise ValueError(
            f"P2RStrategy(micro_batches={micro_batches}) is fewer than pipeline_parallel={pipeline_parallel}: the "
            f"pipeline never fills and the ranks mostly wait. Use micro_batches >= {pipeline_parallel} (a few times "
            "more makes the bubble small)")
    if schedule == "interleaved_1f1b" and micro_batches % pipeline_parallel:
        raise ValueError(
            f"P2RStrategy(pipeline_schedule='interleaved_1f1b') runs micro-batches in rounds of pipeline_parallel="
            f"{pipeline_parallel}: micro_batches={micro_batches} must be a multiple of it")


def check_options(layout: Layout) -> None:
    """Each option on its own, and the pipeline's micro-batches (the strategy checks these when it is built)."""
    if layout.sharding not in SHARDINGS:
        raise ValueError(f"P2RStrategy.sharding must be one of {SHARDINGS}, got {layout.sharding!r}")
    check_parallel_options(layout)
    # A layout's micro-batches under plain standard accumulation are the Trainer's ``accumulate_grad_batches``
    # (``Layout.trainer_accumulation``), which the strategy's ``micro_batches`` keyword refuses to stand for.
    strategy_micro_batches = layout.micro_batches if layout.trainer_accumulation == 1 else 1
    check_accumulation_options(layout.accumulation, strategy_micro_batches, layout.recompute,
                               pipelined=layout.pipelined)
    check_compile_option(layout.compile)
    check_bool("reduce_every_micro_batch", layout.reduce_every_micro_batch)
    if not 0.0 <= layout.offload_fraction <= 1.0:
        raise ValueError(f"P2RStrategy.offload_fraction must be in [0, 1], got {layout.offload_fraction}")
    if not layout.pipelined:
        return
    check_micro_batches(layout.pipeline_schedule, layout.micro_batches, layout.pipeline_parallel)


def check_combinations(layout: Layout) -> None:
    """Options that each are valid but do not go together (the strategy checks them when it chooses its engine,
    before any process group exists)."""
    if not layout.pipelined:
        return
    if layout.sharding == "zero1" and layout.model_parallel:
        raise ValueError(
            "P2RStrategy(sharding='zero1') with tensor_parallel or expert_parallel inside pipeline stages: ZeRO-1's "
            "partitioned optimizer does not take parameters split over a device mesh there; use sharding='zero2' or "
            "'zero3'")
    if layout.accumulation == "layered" and layout.pipeline_schedule not in BREADTH_FIRST:
        raise ValueError(
            f"P2RStrategy(accumulation='layered', pipeline_schedule={layout.pipeline_schedule!r}): across pipeline "
            "stages, layered accumulation is the breadth-first schedule itself; use pipeline_schedule='looped_bfs' "
            "(or 'gpipe' with one stage per rank)")
    if layout.reduce_every_micro_batch:
        raise ValueError("P2RStrategy(reduce_every_micro_batch=True) does not apply with pipeline_parallel > 1: "
                         "the schedule reduces each stage's gradients once, after its last micro-batch")


def check_devices(layout: Layout, devices: int, *, accelerator: bool = True) -> ParallelDims:
    """The degrees against the number of processes; ``accelerator``: the processes drive accelerators (the
    planner's clusters do; a CPU-only run does not)."""
    dims = layout.dims(devices)
    if (layout.sharding == "zero1" and layout.offloading and accelerator
            and layout.path(devices) not in ("local", "ddp")):
        raise ValueError(
            "P2RStrategy(sharding='zero1') with offloaded blocks across processes on an accelerator: "
            "ZeroRedundancyOptimizer broadcasts its partitions through the accelerator's process group, which "
            "cannot send host-resident tensors; use sharding='zero2' (optimizer states and gradients sharded)")
    return dims


def check_model(layout: Layout, model: ModelShape, devices: int | None = None) -> None:
    """Refuse a model these degrees cannot split, naming the numbers (and the config fields that hold them)."""
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    owner = model.owner

    def size(name: str, value: int) -> str:  # "num_local_experts=3 (or num_experts)"
        field, _, aliases = model.field(name).partition(" (")
        return f"{owner}'s {field}={value}" + (f" ({aliases}" if aliases else "")

    if model.num_heads is not None and model.num_heads % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits attention by heads: "
                         f"{size('num_heads', model.num_heads)} must be divisible by it (use tensor_parallel in "
                         f"{divisors(model.num_heads)})")
    if model.num_kv_heads is not None and model.num_kv_heads % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits attention by heads: "
                         f"{size('num_kv_heads', model.num_kv_heads)} must be divisible by it (use tensor_parallel "
                         f"in {divisors(model.num_kv_heads)})")
    if model.vocab_size is not None and model.vocab_size % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits the embedding and output by vocabulary: "
                         f"{size('vocab_size', model.vocab_size)} must be divisible by it")
    if model.hidden_dim is not None and model.hidden_dim % tp:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) splits the feed-forward layers and experts by hidden "
                         f"units: {size('hidden_dim', model.hidden_dim)} must be divisible by it (use "
                         f"tensor_parallel in {divisors(model.hidden_dim)})")
    if ep > 1 and not model.moe:
        raise ValueError(f"P2RStrategy(expert_parallel={ep}) needs MoE layers, and {owner} has none "
                         f"({model.field('moe_layers')})")
    if ep > 1 and model.num_experts % ep:
        raise ValueError(f"P2RStrategy(expert_parallel={ep}) gives each expert-parallel rank num_experts / "
                         f"expert_parallel experts: {size('num_experts', model.num_experts)} must be divisible "
                         f"by it (use expert_parallel in {divisors(model.num_experts)})")
    if layout.pipeline_parallel > 1 and model.moe and model.loss_free_balancing:
        raise ValueError(f"P2RStrategy(pipeline_parallel={layout.pipeline_parallel}) with the model's "
                         "router_balance='bias': the biases' per-step load sum runs over every rank's MoE layers, "
                         "which differ between stages; use router_balance='aux_loss' with pipelines")
    if (tp > 1 or ep > 1) and model.moe and model.always_on_experts:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}, expert_parallel={ep}) does not split MoE layers with "
                         "always-on experts yet (the model's always_on_experts): train them with data parallelism, "
                         "sharding and offload, or set always_on_experts=0")
    if tp > 1 and model.moe and model.shared_experts:
        raise ValueError(f"P2RStrategy(tensor_parallel={tp}) cannot split experts that share one FFN "
                         "(the model's num_unique_experts): upcycle them first (PseudoToReal or delink); expert "
                         "parallelism keeps a shared FFN whole on every rank until then")
    if layout.sequence_parallel and model.rotary_positions is False:
        raise ValueError("P2RStrategy(sequence_parallel=True) needs the model's position_embedding='rotary': learned "
                         "positions are added to the whole sequence, which no rank holds")
    if layout.sequence_parallel and model.max_seq_len is not None and model.max_seq_len % tp:
        raise ValueError(f"P2RStrategy(sequence_parallel=True) splits sequences over tensor_parallel={tp} ranks: "
                         f"the model's max_seq_len={model.max_seq_len} must be divisible by it (and so must every "
                         "batch's sequence length)")
    if layout.pipelined:
        cut = StageCut(devices or layout.pipeline_parallel, layout.pipeline_parallel, layout.stages_per_rank,
                       model.num_layers)
        if model.layer_to_block is not None:
            check_local_sharing(model.layer_to_block, cut)


def check_batch(layout: Layout, sequences: int) -> None:
    """``sequences`` per data-parallel rank per optimizer step against the micro-batches that split them."""
    if sequences % layout.micro_batches:
        raise ValueError(f"P2RStrategy(micro_batches={layout.micro_batches}) must divide the {sequences} sequences "
                         "per data-parallel rank")


def check_trainer(layout: Layout, accumulate_grad_batches: int, batch_size: object = None) -> None:
    """Where the strategy splits each batch itself (layered accumulation, pipelines), Lightning must not accumulate
    too, and a batch size the data declares must split (other data is checked at its first batch). Lightning itself
    takes ``accumulate_grad_batches=0`` and fails at the first batch (a modulo by zero): refused here first."""
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int) \
            or accumulate_grad_batches < 1:
        raise ValueError("Trainer(accumulate_grad_batches=...) must be an integer >= 1 (batches per optimizer step), "
                         f"got {accumulate_grad_batches!r}")
    if layout.accumulation != "layered" and not layout.pipelined:
        return
    if accumulate_grad_batches != 1:
        raise ValueError(
            f"P2RStrategy(micro_batches={layout.micro_batches}, accumulation={layout.accumulation!r}) splits each "
            f"batch itself; set Trainer(accumulate_grad_batches=1), got {accumulate_grad_batches}")
    if isinstance(batch_size, int) and batch_size % layout.micro_batches:
        choices = [d for d in range(layout.pipeline_parallel, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"P2RStrategy(micro_batches={layout.micro_batches}) must divide the batch size, and the "
                         f"data's batch_size is {batch_size}: choose micro_batches among {choices} or change "
                         "data.batch_size")


def oversubscription_warning(device_type: str, processes: int, cores: int) -> str | None:
    """The warning for more CPU processes than cores on this node, or None."""
    if device_type != "cpu" or processes <= cores:
        return None
    return (f"P2RStrategy: {processes} CPU processes on {cores} cores: each waits for the others at every "
            f"collective, so steps slow down many times over. Use at most --trainer.devices={cores} (and "
            "OMP_NUM_THREADS=1 per process) on this machine.")


def half_precision_warning(precision: str) -> str | None:
    """The warning for ``precision="16-true"``, or None. fp16 weights, gradients and optimizer moments with no loss
    scaling: gradients below fp16's range vanish and Adam's second moment underflows, so the loss stalls or turns NaN
    (a 4-layer Llama on bytes went NaN within 40 steps under a plain Trainer too). Lightning runs it as asked; the
    warning names the precisions that train."""
    if precision != "16-true":
        return None
    return ("P2RStrategy: precision='16-true' keeps weights, gradients and AdamW's moments in fp16 with no loss "
            "scaling, which underflows and often ends in a NaN loss (with any strategy). Use 'bf16-true' on a device "
            "with bf16, or '16-mixed' / 'bf16-mixed' (fp32 weights, loss scaling for fp16).")


def check_layout(layout: Layout, devices: int | None = None, model: ModelShape | None = None,
                 sequences: int | None = None, *, accelerator: bool = True) -> None:
    """Every rule that applies to what is known: the options, and the devices, the model's sizes and the sequences
    per data-parallel rank when given. Raises ValueError naming the first reason the layout cannot run."""
    check_options(layout)
    check_combinations(layout)
    if devices is not None:
        check_devices(layout, devices, accelerator=accelerator)
    if model is not None:
        check_model(layout, model, devices)
    if sequences is not None:
        check_batch(layout, sequences)
