"""What the strategy and the callbacks need from a model or a strategy, as contracts (``typing.Protocol``) instead of
attribute probes. A module that satisfies them is placed, offloaded, sharded, delinked and run layer by layer;
nothing here imports the strategy, so model and module code can depend on it freely.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class BlockSequence(Protocol):
    """A model made of blocks: ``blocks`` holds the unique blocks, ``layer_to_block[layer]`` says which one each
    layer runs (several layers share a block in a pseudo model). Delinking, offload and sharding work per block."""

    blocks: nn.ModuleList
    layer_to_block: list[int]


@runtime_checkable
class InitializesByName(Protocol):
    """A model that knows each parameter's initial value from its name (``lightning_p2r.models.init``), so a
    strategy can materialize it piece by piece, anywhere, with the values an eager build gives."""

    init_seed: int

    def initial_value(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole initial value of parameter ``name``: a new tensor, or written into ``out``."""
        ...


@runtime_checkable
class NamesBlockList(Protocol):
    """A LightningModule that says where its model's block list is, for a model whose blocks are not called
    ``blocks`` (``CausalLMModule`` reads its model's declaration): a dotted path from the module. The module whose
    forward runs them is, unless it also :class:`NamesBlockHolder`, the list's nearest ancestor that is not a
    container (as for ``P2RStrategy(blocks=...)``)."""

    def block_list(self) -> str:
        """The ``nn.ModuleList`` of blocks."""
        ...


@runtime_checkable
class NamesBlockHolder(Protocol):
    """A :class:`NamesBlockList` module that also names the module whose forward runs the blocks."""

    def block_holder(self) -> str:
        """The module whose forward runs the blocks and returns what the LightningModule reads (the logits)."""
        ...


@runtime_checkable
class InitializesModules(Protocol):
    """A LightningModule that initializes its model's modules itself (a user's rule for a model built on the meta
    device): ``init_module(module)`` fills one module's own parameters and buffers, in place, from the global random
    stream (the strategy seeds it per module, so the values do not depend on the layout)."""

    def init_module(self, module: nn.Module) -> None: ...


@dataclass
class LayeredStages:
    """What the executor needs from a model beyond its block sequence.

    The context returned by ``embed`` is handed to every ``layer`` call and to ``head`` of the same micro-batch;
    it must not hold tensors that require grad (only the hidden state carries gradient from stage to stage). A
    layer may be called twice per micro-batch (forward, then recompute): it must not accumulate into the context.
    """

    embed: Callable[[Any], tuple[torch.Tensor, Any]]
    """micro-batch -> (hidden states, context)."""
    layer: Callable[[int, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor | None]]
    """(layer, hidden, context) -> (hidden, extra loss of this layer already weighted, or None)."""
    head: Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """(hidden, context) -> (micro-batch loss, detached metrics)."""
    layer_to_block: Sequence[int]
    """Which block each layer runs; its length is the number of layers."""
    log_metrics: Callable[[dict[str, torch.Tensor]], None] | None = None
    """The strategy calls it with the mean metrics of a step; the executor never does."""



@runtime_checkable
class DefinesLayeredStages(Protocol):
    """A LightningModule that layered gradient accumulation can run stage by stage."""

    def layered_stages(self) -> LayeredStages: ...


@dataclass
class PipelineParts:
    """What pipeline parallelism needs from a model beyond its layered stages: which modules the first and last
    stages hold, how a later stage rebuilds a micro-batch's context without the embedding, and how the router
    records of the stages on other ranks come together into one step's metrics.

    Every rank of a pipeline reads the same batch, so a stage computes a micro-batch's context (positions, targets)
    from the micro-batch itself; only the hidden states travel between stages.
    """

    stages: LayeredStages
    """embed, layer and head as layered accumulation runs them (the head returns the micro-batch's loss)."""
    context: Callable[[Any], Any]
    """micro-batch -> the context ``stages.embed`` would return with it, without running the embedding."""
    embed_modules: list[nn.Module]
    """The modules ``stages.embed`` reads (held by the first stage)."""
    head_modules: list[nn.Module]
    """The modules ``stages.head`` and ``logits`` read (held by the last stage)."""
    logits: Callable[[torch.Tensor], torch.Tensor]
    """last hidden states -> logits (evaluation runs the pipeline up to here)."""
    window: Callable[[torch.Tensor], Any]
    """the model forward's input -> a micro-batch the stages take, for evaluation (its targets are not read)."""
    output: Callable[[torch.Tensor], Any]
    """logits -> what the model's forward returns (so evaluation code that calls the model reads the same type)."""
    records: Callable[[Any], dict[str, Any]]
    """context -> the detached per-layer records its layers left (router losses and statistics), to send to the
    last stage's rank."""
    absorb: Callable[[Any, dict[str, Any]], None]
    """Add another stage's records to a context of the same micro-batch."""
    metrics: Callable[[torch.Tensor, Any], dict[str, torch.Tensor]]
    """(micro-batch loss, context holding every layer's records) -> the detached metrics ``stages.head`` gives on
    one process; ``metrics["loss"]`` is the micro-batch's total loss."""


@runtime_checkable
class DefinesPipelineStages(Protocol):
    """A LightningModule that pipeline parallelism can cut into stages."""

    def pipeline_parts(self) -> PipelineParts: ...


@runtime_checkable
class DelinksInPlace(Protocol):
    """A strategy that delinks a model where it lives (placed, offloaded, sharded) and re-places the new blocks;
    ``PseudoToReal`` hands the delinking to it and then rebinds the learning-rate schedulers itself."""

    def delink_model(self, pl_module: Any, optimizer: torch.optim.Optimizer, num_unique_blocks: int | None,
                     optimizer_state: str, perturb: Any = None) -> torch.optim.Optimizer: ...


@runtime_checkable
class ScreensLoss(Protocol):
    """A LightningModule with a policy for unusable (non-finite) losses: a step whose loss it refuses is skipped.
    The strategy's own step runners (layered, pipelined) ask it as the module's ``training_step`` does."""

    def loss_is_usable(self, loss: torch.Tensor) -> bool: ...


@runtime_checkable
class ComputesTokenLoss(Protocol):
    """A LightningModule whose training loss reads its cross-entropy from ``token_loss(logits, targets)``, so a
    tensor-parallel strategy can give it a vocabulary-parallel one (the logits then stay sharded)."""

    token_loss: Any


SplitKind = Literal["column", "row", "sequence", "expert", "vocabulary", "output", "heads", "gather", "packed_column",
                    "gathered_column", "row_of_whole"]
"""How one submodule splits over the tensor-parallel ranks (Megatron-LM):

- "column": a linear layer whose output features are split (the first matmul of a pair);
- "row": a linear layer whose input features are split, the partial outputs summed (the second of the pair);
- "sequence": a module run on this rank's sequence positions under sequence parallelism (a norm), whole otherwise;
- "expert": an MoE layer (the module that routes): whole on every tensor-parallel rank (under sequence parallelism
  it sees the whole sequence); the stacked expert weights inside it are declared in ``ParallelPlan.experts``;
- "vocabulary": an embedding split by vocabulary rows (the partial lookups summed);
- "output": the output layer split by vocabulary columns (each rank its shard of the logits);
- "heads": a module run on this rank's attention heads, its input shaped (batch, sequence, heads, head_dim) and
  normalized over ``head_dim`` (a per-head norm, as Qwen3's ``q_norm`` and ``k_norm``): its weights whole on every
  rank, their gradients summed over the ranks (Hugging Face's "replicated_with_grad_allreduce");
- "gather": under sequence parallelism, a module (an attention, an MLP) whose input hidden states (its first
  positional argument, or ``hidden_states=``) are gathered from the ranks' positions at its entry, so that it runs on
  the whole sequence, its column layers included (torchtitan's plan for Llama); nothing without sequence
  parallelism. A plan with "gather" entries keeps the embedding's output whole (a model that derives positions from
  it, as Hugging Face's do) and cuts the hidden states to the rank's positions at the first block's entry.
- "packed_column": a linear layer whose output features pack several column-split parts one after another (q, k
  and v of an attention in one matrix, as litgpt's ``qkv``; their sizes in ``ParallelPlan.packed``): each rank
  computes its share of every part. The weight stays split in contiguous rows (so checkpoints keep the model's own
  layout) and is gathered for each forward (its gradient reduce-scattered), as ZeRO-3 does for a whole layer.
- "gathered_column": a linear layer inside a block whose output features are split for the matmul and gathered
  whole after it (Hugging Face's "colwise_gather_output" on OLMo 2's q/k/v, whose norms run over all heads at once):
  every rank then runs the attention on all heads;
- "row_of_whole": a row layer whose input arrives whole on every rank: each multiplies its share of the input
  features and the partial outputs are summed (Hugging Face's "rowwise_split_input", OLMo 2's o_proj after it).
"""


ExpertCall = Literal["sorted", "top_k"]
"""How an expert module is called, which says how expert parallelism sends it rows:

- "sorted": ``forward(rows, counts)``: rows sorted by expert, ``counts[e]`` rows for expert e (a tensor), rows past
  their sum dropped (zeros out) -> one output row per input row (``lightning_p2r.models.moe.Experts``);
- "top_k": ``forward(hidden, top_k_index, top_k_weights)``: every token with its k experts and gate weights ->
  the gate-weighted sum over its experts (Hugging Face's ``MixtralExperts``, ``Qwen3MoeExperts``).
"""


@dataclass(frozen=True)
class StackedExperts:
    """A module holding an MoE layer's experts as stacked weights, one slice per expert along dimension 0 (what
    Hugging Face's ``base_model_ep_plan`` calls "grouped_gemm" weights). Expert parallelism gives each rank a
    contiguous share of the experts and runs the module's own ``forward`` on them; tensor parallelism, where a weight
    names its hidden-unit dimension, splits each expert's hidden units too."""

    weights: dict[str, int | None]
    """Stacked parameter name (in the module) -> its dimension of hidden units, split by tensor parallelism (the
    output dimension of the first matmul, the input of the second); None where the weight cannot split that way
    (gate and up projections packed in one tensor): tensor parallelism then splits the module by expert instead
    (:attr:`splits_by_expert_over_tensor_parallel`)."""
    call: ExpertCall
    """How the module's ``forward`` is called (:data:`ExpertCall`)."""
    counts: tuple[str, ...] = ("num_experts",)
    """Attributes of the module holding its number of experts: set to this rank's number once it is split."""

    @property
    def splits_by_expert_over_tensor_parallel(self) -> bool:
        """Whether tensor parallelism gives each rank whole experts (a share of them; every rank sees the same
        tokens, runs those routed to its experts, and the partial outputs are summed, as Megatron-Core does with
        ``expert_tensor_parallel_size=1``) rather than a share of every expert's hidden units: when a weight declares
        no hidden-unit dimension. Only a "top_k" module splits this way."""
        return any(dim is None for dim in self.weights.values())


@dataclass(frozen=True)
class ParallelPlan:
    """Which submodules of a block-sequence model split how, by the model's own names. The model declares it; the
    strategy turns each kind into torch's ``ParallelStyle`` and applies it from outside."""

    blocks: tuple[dict[str, SplitKind], ...]
    """Per block (``blocks[i]``): names inside the block."""
    outside: dict[str, SplitKind]
    """Names inside the model (the block-sequence holder), outside its blocks."""
    experts: dict[str, StackedExperts] = field(default_factory=dict)
    """Expert modules by name inside a block (the same in every block that has one): what expert parallelism
    splits."""
    packed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """For each "packed_column" entry (by its name inside a block): the sizes of its packed parts, in order along
    the output features (litgpt's ``qkv``: the query, key and value rows)."""
    transposed: frozenset[str] = frozenset()
    """Entries inside a block whose weight is stored in x out and applied as ``x @ weight + bias`` (GPT-2's
    ``Conv1D``), which the strategy splits along the other dimension than an ``nn.Linear``'s."""
    gathers_for_sequence_parallel: bool = False
    """Whether the strategy adds what sequence parallelism needs, as it does for a Hugging Face plan: the block's
    norms and the final norm "sequence", the modules holding column layers "gather" (the sequence all-gathered at
    their entry). For a model whose attention reshapes by the length it is given (litgpt's, Hugging Face's)."""
    divisible: dict[str, int] = field(default_factory=dict)
    """Sizes the tensor-parallel degree must divide, by name (heads, key/value groups, widths, the vocabulary): a
    degree that does not is refused in one line naming them, before anything is split."""
    on_tensor_parallel: Callable[[int], None] | None = None
    """Called with the tensor-parallel degree once the plan is applied: for a model whose forward reads head counts
    from a config rather than from its tensors' shapes (litgpt's attention), to give each split module its rank's
    counts. None for models that need nothing (the package's own, Hugging Face's)."""

    def kinds(self) -> set[SplitKind]:
        """Every kind the plan uses, in its blocks or outside them."""
        return {kind for entries in (*self.blocks, self.outside) for kind in entries.values()}

    def expert_layers(self, holder: nn.Module, indices: Sequence[int] | None = None) -> list[nn.Module]:
        """The "expert" submodules of the blocks (all, or those at ``indices``)."""
        chosen = range(len(self.blocks)) if indices is None else indices
        return [holder.blocks[i].get_submodule(name) for i in chosen
                for name, kind in self.blocks[i].items() if kind == "expert"]

    def stacked_experts(self, holder: nn.Module, indices: Sequence[int] | None = None
                        ) -> list[tuple[nn.Module, StackedExperts]]:
        """The declared expert modules of the blocks (all, or those at ``indices``) that have them, with their
        declarations."""
        chosen = range(len(self.blocks)) if indices is None else indices
        found = []
        for index in chosen:
            names = {name for name, _ in holder.blocks[index].named_modules()}
            found += [(holder.blocks[index].get_submodule(name), declared) for name, declared in self.experts.items()
                      if name in names]
        return found


@runtime_checkable
class BalancesOverRanks(Protocol):
    """An MoE layer whose load-balancing loss can count the tokens of every process that sees a different batch, as
    one process given the whole batch would; when the strategy splits the model it hands the layer a differentiable
    sum over those processes (None where there is one), so the model imports no torch.distributed."""

    def balance_over(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None) -> None: ...


class DeclaredPlan:
    """A ``parallel_plan()`` given to a model that has none (litgpt's ``GPT``, Hugging Face's GPT-2) as an instance
    attribute: ``plan_of(model)`` for the model it is attached to. The strategy calls ``plan_of`` with the module it
    places, which may be a copy of the model it was attached to (delinking under sharding places one); a deep copy
    gets one for the copy, without copying anything else."""

    def __init__(self, plan_of: Callable[[nn.Module], ParallelPlan], model: nn.Module) -> None:
        self.plan_of = plan_of
        self._model = weakref.ref(model)

    def __call__(self) -> ParallelPlan:
        model = self._model()
        if model is None:
            raise RuntimeError("the model this parallel plan was declared for no longer exists")
        return self.plan_of(model)

    def __deepcopy__(self, memo: dict[int, Any]) -> DeclaredPlan:
        model = self._model()
        return DeclaredPlan(self.plan_of, memo.get(id(model), model))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its model (Lightning's spawn launchers pickle the LightningModule): a weak reference cannot be.
        return DeclaredPlan, (self.plan_of, self._model())

    @classmethod
    def attach(cls, model: nn.Module, plan_of: Callable[[nn.Module], ParallelPlan]) -> None:
        """Give ``model`` the ``parallel_plan()`` computed by ``plan_of(model)``."""
        vars(model)["parallel_plan"] = cls(plan_of, model)


@runtime_checkable
class DeclaresParallelPlan(Protocol):
    """A block-sequence model that tensor / expert parallelism can split: it names its own column, row, sequence,
    expert, vocabulary and output submodules (``M6Transformer.parallel_plan`` is the example)."""

    def parallel_plan(self) -> ParallelPlan: ...


@runtime_checkable
class HoldsWeight(Protocol):
    """A layer with one ``weight`` (a linear layer, an embedding): what the plan's "vocabulary" and "output" kinds
    split and what tied layers share. A pipeline stand-in for a layer another rank holds has none."""

    weight: torch.Tensor


@runtime_checkable
class ModelSizes(Protocol):
    """The sizes the layout rules check before anything is placed (``lightning_p2r.layout.ModelShape.of`` reads
    them); ``M6Config`` has them."""

    num_layers: int
    layer_to_block: list[int]
    num_heads: int
    vocab_size: int
    hidden_dim: int
    num_experts: int
    moe_layers: list[int] | None
    max_seq_len: int
    position_embedding: str


@runtime_checkable
class StatesSizes(Protocol):
    """A block-sequence model whose ``config`` states its :class:`ModelSizes` (``M6Transformer``): the strategy
    checks the layout against them before placing anything; another model is checked by what placement reads."""

    config: ModelSizes


@runtime_checkable
class StatesShape(Protocol):
    """A LightningModule that states its model's sizes before the model exists (``CausalLMModule`` reads them from
    its Hugging Face or litgpt config), so the strategy checks the layout against them in the launching process,
    before any other rank starts, as it does for a :class:`StatesSizes` model."""

    def model_shape(self) -> Any:
        """A ``lightning_p2r.layout.ModelShape`` naming the config's own fields, or None where the sizes are not
        known before the model is built."""
        ...

