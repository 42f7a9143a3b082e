"""Decoder-only language models the package did not write (Hugging Face ``transformers``, litgpt), cut into the
stages layered gradient accumulation runs, from a small declaration of where their parts are (issue 38, item 4).

A declaration names the block list, the modules the embedding stage reads, the final norm and the head, and the
module whose ``forward`` embeds the tokens and runs the blocks. How a block is *called* (rotary tables, masks,
position ids, each family's keyword names) is not declared: the embedding stage runs that module's own forward up
to the first block and records the arguments the model passes it, then every layer is called with the same
arguments. So a family's masking or positions rule is the model's own code, never a copy of it.

Ready declarations cover Hugging Face's Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE and GPT-2
(by ``config.model_type``) and litgpt's ``GPT``. Any other Hugging Face decoder's parts are found from the
conventions every ``PreTrainedModel`` follows (:func:`discovered_parts`); any other decoder passes its own
:class:`DecoderParts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..protocols import LayeredStages, PipelineParts
from .hf_parts import find_parts
from .router_loss import (
    RoutingRecords,
    adds_balance_loss,
    finish_micro_batch,
    router_loss_of,
    run_recording_routers,
)


@dataclass(frozen=True)
class DecoderParts:
    """Where a decoder-only causal LM keeps its parts, by dotted names from the model (the causal LM itself)."""

    blocks: str
    """The block list (an ``nn.ModuleList``), run in order once each."""
    embed: tuple[str, ...]
    """The modules the embedding stage reads (token and learned position embeddings): the first pipeline stage's."""
    norm: str
    """The final norm, applied to the last block's output."""
    head: str
    """The output layer (logits)."""
    base: str = ""
    """The module whose forward embeds the tokens and runs the blocks ("" for the model itself)."""
    call: str = "keywords"
    """How ``base`` is called on token ids: "keywords" (Hugging Face: ``input_ids=..., use_cache=False``) or
    "positional" (litgpt: ``base(ids)``)."""
    residual_outputs: tuple[str, ...] = ()
    """Endings of a block's parameter names that are the last projections of its residual branches (attention
    output, FFN or expert down projection): zeroed on the layers a shallow pseudo model gains with
    ``growth_init="zero_outputs"``, so each adds nothing to the residual stream at first."""
    logits_from: str = "head"
    """How the last stage turns the last block's output into logits: "head" (``head(norm(hidden))``) or "forward"
    (the causal LM's own forward with ``base`` standing in and returning ``norm(hidden)``: whatever the model does
    after its head, such as Gemma 2's logit soft-capping or Granite's logit scaling, runs too)."""
    unstageable: str = ""
    """Why layered accumulation and pipelines cannot run this decoder as stages ("" when they can): set when the
    parts were found from Hugging Face's conventions (:func:`discovered_parts`) and the base runs a module besides
    its embeddings, blocks and norms (OPT's ``project_in`` and ``project_out``), which no stage would run."""


_LLAMA_LIKE = DecoderParts(blocks="model.layers", embed=("model.embed_tokens",), norm="model.norm", head="lm_head",
                           base="model", residual_outputs=("o_proj.weight", "o_proj.bias", "down_proj.weight",
                                                           "down_proj.bias", "experts.down_proj"))
KNOWN_DECODERS: dict[str, DecoderParts] = {
    **{family: _LLAMA_LIKE for family in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")},
    "gpt2": DecoderParts(blocks="transformer.h", embed=("transformer.wte", "transformer.wpe"),
                         norm="transformer.ln_f", head="lm_head", base="transformer",
                         residual_outputs=("c_proj.weight", "c_proj.bias")),
    # litgpt's GPT: GPT.forward embeds (transformer.wte) and runs transformer.h, a ModuleDict's list.
    "litgpt": DecoderParts(blocks="transformer.h", embed=("transformer.wte",), norm="transformer.ln_f",
                           head="lm_head", base="", call="positional",
                           residual_outputs=("attn.proj.weight", "attn.proj.bias", "mlp.proj.weight", "mlp.proj.bias")),
}
"""Ready declarations: Hugging Face ``config.model_type`` -> parts; "litgpt" for litgpt's ``GPT``."""


def family_of(model: nn.Module) -> str | None:
    """The key of ``model``'s ready declaration in :data:`KNOWN_DECODERS`, or None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type in KNOWN_DECODERS:
        return model_type
    # The MRO, not the class: FSDP2 swaps a sharded module's class for a subclass (FSDPGPT).
    if any(cls.__name__ == "GPT" and cls.__module__.startswith("litgpt") for cls in type(model).__mro__):
        return "litgpt"
    return None


def decoder_parts(model: nn.Module, parts: DecoderParts | None = None) -> DecoderParts:
    """``parts`` if given, else the ready declaration of ``model``'s family, else the parts a Hugging Face model's
    conventions show (:func:`discovered_parts`); checked against the model by name."""
    if parts is None:
        family = family_of(model)
        parts = KNOWN_DECODERS[family] if family is not None else discovered_parts(model)
        if parts is None:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise ValueError(
                f"no ready declaration for {type(model).__name__} (model_type {model_type!r}; known: "
                f"{sorted(KNOWN_DECODERS)}), and its parts could not be found from Hugging Face's conventions (one "
                "nn.ModuleList of the classes its _no_split_modules names, a final norm after it, "
                "get_input_embeddings() and get_output_embeddings()). Pass lightning_p2r.models.decoders.DecoderParts("
                "blocks=..., embed=..., norm=..., head=..., base=...) naming its parts")
    for name in (parts.blocks, *parts.embed, parts.norm, parts.head, parts.base):
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the decoder declaration names {name!r}, which {type(model).__name__} does not have"
                             ) from None
    if not isinstance(model.get_submodule(parts.blocks), nn.ModuleList):
        raise ValueError(f"the decoder declaration's blocks {parts.blocks!r} is not an nn.ModuleList")
    return parts


def discovered_parts(model: nn.Module) -> DecoderParts | None:
    """A Hugging Face decoder's parts from its own conventions (``models.hf_parts``), or None where they do not show
    them; ``unstageable`` says what layered accumulation and pipelines would skip, if anything."""
    found = find_parts(model)
    return DecoderParts(**found) if found is not None else None


class _BaseOutput:
    """What a base model's forward returns, standing in: the final norm's output as ``last_hidden_state`` and
    ``[0]``; any other field (caches, router logits, attentions) None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:
        return None


class _NormedBase(nn.Module):
    """Stands in for the base while the causal LM's own forward computes the logits from given hidden states."""

    def __init__(self, norm: nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        self.norm, self.hidden = norm, hidden

    def forward(self, *args: Any, **kwargs: Any) -> _BaseOutput:
        return _BaseOutput(self.norm(self.hidden))


def logits_function(model: nn.Module, parts: DecoderParts) -> Callable[[torch.Tensor], torch.Tensor]:
    """The last blocks' hidden states -> logits, as ``parts.logits_from`` says."""
    norm, head = model.get_submodule(parts.norm), model.get_submodule(parts.head)
    if parts.logits_from == "head":
        return lambda hidden: head(norm(hidden))
    if parts.logits_from != "forward" or not parts.base:
        raise ValueError(f"DecoderParts.logits_from must be 'head', or 'forward' with a base, got "
                         f"{parts.logits_from!r} (base {parts.base!r})")
    owner_name, _, attribute = parts.base.rpartition(".")
    owner = model.get_submodule(owner_name)
    forward = type(model).forward  # the class's: not through __call__, whose hooks belong to the whole model's call

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        base = owner._modules[attribute]
        owner._modules[attribute] = _NormedBase(norm, hidden)
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            output = forward(model, input_ids=ids, use_cache=False)
        finally:
            owner._modules[attribute] = base
        return output if isinstance(output, torch.Tensor) else output.logits

    return logits


def check_stageable(model: nn.Module, parts: DecoderParts, layout: str) -> None:
    """Refuse running ``model`` as stages (``layout``: "layered accumulation", "pipeline parallelism") where its
    declaration says the stages would skip part of its forward."""
    if parts.unstageable:
        raise ValueError(f"{layout} runs {type(model).__name__} as stages (embedding, blocks, then "
                         "its logits) and would skip part of its forward: "
                         f"{parts.unstageable}. Use accumulation='standard' without pipeline_parallel for this model "
                         "(every other layout runs its own forward)")


class _LastBlockReached(Exception):
    """Raised by the last layer's stand-in: the base forward stops before its final norm."""


@dataclass
class BlockCall:
    """The arguments the model's forward passes each layer's block besides the hidden states, and the micro-batch's
    targets. Holds no tensor that requires grad (masks, rotary tables and positions are computed from the tokens
    alone)."""

    layers: list[tuple[tuple[Any, ...], dict[str, Any]]]
    """Per layer, the positional arguments after the hidden states and the keyword arguments. Layers may get
    different ones: Qwen3 with sliding windows passes its sliding layers another attention mask than its full ones."""
    targets: torch.Tensor
    routing: RoutingRecords | None = None
    """The micro-batch's router records, where the model adds a load-balancing loss over all its layers."""

    @property
    def args(self) -> tuple[Any, ...]:
        """The first layer's positional arguments after the hidden states."""
        return self.layers[0][0]

    @property
    def kwargs(self) -> dict[str, Any]:
        """The first layer's keyword arguments."""
        return self.layers[0][1]


class _RecordingStandIn(nn.Module):
    """Stands in for one layer's block while the base forward runs: records how the model calls that layer and hands
    the hidden states on unchanged; the last layer's stops the forward."""

    def __init__(self, index: int, calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]], last: int) -> None:
        super().__init__()
        self.index, self.calls, self.last = index, calls, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.index] = (args, kwargs)
        if self.index == self.last:
            raise _LastBlockReached
        return args[0] if args else kwargs["hidden_states"]


def block_output(output: Any) -> torch.Tensor:
    """A block's hidden states, whether it returns them or a tuple starting with them (older transformers)."""
    return output[0] if isinstance(output, tuple) else output


def embed_and_block_call(model: nn.Module, parts: DecoderParts, tokens: torch.Tensor,
                         blocks: nn.ModuleList) -> tuple[torch.Tensor, BlockCall]:
    """Run the base forward on ``tokens`` with every entry of the model's layer list ``blocks`` standing in: the
    first layer's input hidden states (with their graph to the embedding) and the other arguments the model passes
    each layer. The blocks themselves are not called (an FSDP2 gather, an offload fetch, do not run), and the final
    norm is not reached."""
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    base = model.get_submodule(parts.base)
    originals = list(blocks)
    # The base's own forward, through __call__ (its hooks run): a pipeline replaces the forward of the module
    # holding the blocks on the instance (evaluation through the stages), and where that module is the base
    # (litgpt's GPT), calling it would start a pipeline evaluation from inside a stage.
    replaced = vars(base).pop("forward", None)
    try:
        for index in range(len(originals)):
            blocks[index] = _RecordingStandIn(index, calls, len(originals) - 1)
        if parts.call == "positional":
            base(tokens)
        else:
            base(input_ids=tokens, use_cache=False)
    except _LastBlockReached:
        pass
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
        if replaced is not None:
            base.forward = replaced
    if not originals or len(calls) != len(originals):
        raise RuntimeError(f"{type(base).__name__}.forward called {len(calls)} of the {len(originals)} entries of "
                           f"its layer list {parts.blocks!r}: the declaration must name the list its forward runs")
    inputs, layers = [], []
    for index in range(len(originals)):
        args, kwargs = calls[index]
        kwargs = dict(kwargs)
        inputs.append(args[0] if args else kwargs.pop("hidden_states"))
        layers.append((tuple(args[1:]), kwargs))
    return inputs[0], BlockCall(layers, targets=torch.empty(0))


def check_pipeline_supported(model: nn.Module) -> None:
    """Refuse what pipeline stages cannot reproduce: a Hugging Face MoE whose load-balancing loss pools all layers'
    routing (``output_router_logits``): a stage runs a micro-batch's backward before it could know the later
    stages' routing, which that loss's gradient needs (``models.router_loss``)."""
    if adds_balance_loss(model):
        raise ValueError(f"{type(model).__name__} adds a load-balancing loss pooled over all its layers "
                         "(config.output_router_logits=True), which pipeline stages cannot reproduce: set "
                         "output_router_logits=False for pipeline parallelism (layered accumulation and the other "
                         "layouts compute it)")


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (batch, seq, vocab) against targets (batch, seq), in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def decoder_stages(model: nn.Module, parts: DecoderParts, layer_to_block: list[int],
                   split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                   log_metrics: Callable[[dict[str, torch.Tensor]], None] | None = None,
                   token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> LayeredStages:
    """Layered accumulation's stages of a decoder ``model`` declared by ``parts``: ``split`` turns a micro-batch into
    (input ids, target ids); the head's loss is the next-token cross-entropy, as the model's training step computes
    it: ``token_loss`` where given (a module's, which tensor parallelism may replace by a vocabulary-parallel one),
    else :func:`next_token_loss`. The stages read the blocks at call time (placement may wrap them).

    A Hugging Face MoE with ``output_router_logits=True`` adds its load-balancing loss, as its own forward does: each
    layer records its routing, the head adds the loss (``models.router_loss``), and the metrics carry "ce" and
    "aux_loss" besides "loss"."""
    check_stageable(model, parts, "layered accumulation")
    blocks = model.get_submodule(parts.blocks)
    logits_of = logits_function(model, parts)
    balance = router_loss_of(model)

    def embed(micro_batch: torch.Tensor) -> tuple[torch.Tensor, BlockCall]:
        inputs, targets = split(micro_batch)
        hidden, call = embed_and_block_call(model, parts, inputs, blocks)
        call.targets = targets
        call.routing = RoutingRecords() if balance is not None else None
        return hidden, call

    def layer(index: int, hidden: torch.Tensor, call: BlockCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The model's own list holds each layer's module (a block shared by several layers at each of them), as its
        # forward runs them; ``layer_to_block`` numbers the unique blocks, not positions in that list.
        block = blocks[index]
        args, kwargs = call.layers[index]
        if balance is None:
            return block_output(block(hidden, *args, **kwargs)), None
        output, term = run_recording_routers(balance, block, index, call.routing,
                                             lambda: block(hidden, *args, **kwargs))
        return block_output(output), term

    def head_stage(hidden: torch.Tensor, call: BlockCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (token_loss or next_token_loss)(logits_of(hidden), call.targets)
        aux = finish_micro_batch(balance, call.routing) if balance is not None else None
        if aux is None:
            return loss, {"loss": loss.detach()}
        # The loss's value joins the head's (its gradient reaches each layer through that layer's term).
        total = loss + balance.coefficient * aux.to(loss.device)
        return total, {"loss": total.detach(), "ce": loss.detach(), "aux_loss": aux}

    return LayeredStages(embed=embed, layer=layer, head=head_stage, layer_to_block=list(layer_to_block),
                         log_metrics=log_metrics)


class _ZeroEmbedding(nn.Module):
    """Stands in for a module of the embedding stage on a pipeline stage that does not hold it, while the stage
    records how the model calls its blocks: the arguments depend on the token positions only, never on the embedded
    values. Token or position ids give zeros of the hidden width; hidden states (Bloom's embedding norm) go on as they
    are. (The module itself may be absent there, so its kind is read off its input.)"""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if ids.is_floating_point() and ids.shape[-1] == self.dim:
            return ids
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


def hidden_size(model: nn.Module, parts: DecoderParts) -> int:
    """The width of the hidden states: Hugging Face's ``config.hidden_size``, litgpt's ``n_embd``, else (a model of
    your own, without a config) the ``embedding_dim`` of the first declared embedding."""
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if isinstance(size, int):
        return size
    for name in parts.embed:
        embedding = model.get_submodule(name)
        if isinstance(embedding, nn.Embedding):
            return embedding.embedding_dim
    raise ValueError(f"cannot tell the hidden size of {type(model).__name__}: no config.hidden_size or n_embd, and "
                     f"none of its declared embeddings {list(parts.embed)} is an nn.Embedding")


@contextmanager
def _embeddings_standing_in(model: nn.Module, names: tuple[str, ...], dim: int) -> Iterator[None]:
    originals = [(name, model.get_submodule(name)) for name in names]
    try:
        for name, _ in originals:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, _ZeroEmbedding(dim, torch.get_default_dtype()))
        yield
    finally:
        for name, module in originals:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, module)


def decoder_pipeline_parts(model: nn.Module, parts: DecoderParts, stages: LayeredStages,
                           split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> PipelineParts:
    """Pipeline parallelism's parts of a decoder ``model`` declared by ``parts`` (``stages``: its layered stages). A
    stage after the first records the block arguments with the embeddings standing in as zeros; evaluation's output
    carries the logits as ``.logits``, as a Hugging Face model's does."""
    check_pipeline_supported(model)
    check_stageable(model, parts, "pipeline parallelism")
    blocks = model.get_submodule(parts.blocks)
    norm, head = model.get_submodule(parts.norm), model.get_submodule(parts.head)
    dim = hidden_size(model, parts)

    def context(micro_batch: torch.Tensor) -> BlockCall:
        inputs, targets = split(micro_batch)
        with _embeddings_standing_in(model, parts.embed, dim):
            _, call = embed_and_block_call(model, parts, inputs, blocks)
        call.targets = targets
        return call

    def metrics(loss: torch.Tensor, call: BlockCall) -> dict[str, torch.Tensor]:
        return {"loss": loss.detach()}

    return PipelineParts(
        stages=stages, context=context, embed_modules=[model.get_submodule(n) for n in parts.embed],
        head_modules=[norm, head], logits=logits_function(model, parts),
        window=lambda inputs: F.pad(inputs, (0, 1)), output=lambda logits: SimpleNamespace(logits=logits),
        records=lambda call: {}, absorb=lambda call, other: None, metrics=metrics)
