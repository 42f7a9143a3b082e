"""Delinking: turn a model whose layers share blocks into one with more unique blocks (M6-10T Pseudo-to-Real).

Pure PyTorch, no Lightning. Works for any ``nn.Module`` that contains a *block sequence*, a submodule with

- ``blocks``: an ``nn.ModuleList`` of the distinct blocks, and
- ``layer_to_block``: a settable ``list[int]``; layer ``l`` runs ``blocks[layer_to_block[l]]``, and layers that
  share a block are consecutive (groups of ``num_layers // len(blocks)``).

``M6Transformer`` declares both; so can a user's own model. A model that runs its own list of layers (a Hugging Face
or litgpt decoder) is made a pseudo model by :func:`share_layers`: its list keeps one entry per layer, the entries
of layers that share a block being the same module, and delinking puts each layer's copy back in that list.
Optionally the holder declares ``full_depth`` (an int larger
than ``len(layer_to_block)``: a *shallow* pseudo model, which runs only its ``len(blocks)`` blocks, block i at layer
i, and which delinking grows towards ``full_depth`` layers, layer i running a copy of block i mod U) and
``growth_init`` ("copy", or "zero_outputs": the output projections of the layers gained are zeroed so the function
is kept). MoE layers whose experts share one FFN (``models.moe.Experts.is_shared``) are upcycled at delinking: every
expert gets its own copy (Komatsuzaki et al. 2022), with the router kept or re-initialized and optional noise as the
holder's ``config`` says (``upcycle_router``, ``upcycle_noise``).

Optimizer state and the "scale" rule. While ``g`` layers share one tensor, its gradient is the *sum* of the ``g``
layers' contributions. After splitting it into ``n`` copies each shared by ``g / n`` layers, each copy's gradient is
the sum over its own layers, about ``1 / n`` of the shared one when the layers' contributions are alike (which is
what sharing trained them towards). Adam's first moment is linear in the gradient, so each copy gets
``exp_avg / n``; the second moment is quadratic, so ``exp_avg_sq / n**2``. With those, the update size
``exp_avg / sqrt(exp_avg_sq)`` of every copy equals the shared tensor's, and training continues smoothly. SGD's
momentum buffer is linear too: ``/ n``. "copy" keeps the state unchanged (each copy then starts with n times its
own gradient scale in its moments, which damps the first updates), and "reset" starts the delinked tensors'
state afresh (bias correction included).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .console.known_warnings import silence_rebound_scheduler_notice
from .models.config import sharing_map
from .models.init import parameter_seed

OptimizerStatePolicy = Literal["copy", "scale", "reset", "per_layer"]
POLICIES = ("copy", "scale", "reset", "per_layer")


class IdentitySet:
    """A set of tensors by identity (tensors compare by value, so a plain set cannot hold them) that keeps them alive:
    a set of ``id()`` s would match a new tensor that reuses a freed one's id."""

    def __init__(self) -> None:
        self._held: dict[int, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self._held[id(tensor)] = tensor

    def __contains__(self, tensor: object) -> bool:
        return self._held.get(id(tensor)) is tensor


@dataclass(frozen=True)
class MeasuredSecondMoments:
    """The "per_layer" policy with its measurement: for each copy's tensor (named inside the block sequence, e.g.
    ``blocks.3.attn.qkv.weight``), the factor its ``exp_avg_sq`` gets from the shared tensor's, measured from the
    layers' own gradients before delinking (``callbacks.per_layer_moments``). Tensors it does not name (norm
    weights) follow "scale"; first moments always follow "scale" (``exp_avg / n``: they forget in ~1/(1 - beta1)
    steps)."""

    ratios: dict[str, torch.Tensor]
    steps: int = 0


@dataclass(frozen=True)
class Perturbation:
    """Symmetry breaking at delinking: every copy of a split block gets Gaussian noise of standard deviation
    ``relative_scale`` times the tensor's RMS, drawn from a generator seeded by (``seed``, parameter name), so every
    rank draws the same noise and each copy its own. It costs function preservation: the delinked model is no longer
    exactly the shared one (the loss moves by roughly the square of the scale for a trained model)."""

    relative_scale: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.relative_scale < 1.0:
            raise ValueError(f"delink noise must be in [0, 1) (relative to each tensor's RMS), got "
                             f"{self.relative_scale!r}")
SUPPORTED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
_LINEAR_STATE = ("exp_avg", "momentum_buffer")
_QUADRATIC_STATE = ("exp_avg_sq", "max_exp_avg_sq")


@dataclass(frozen=True)
class LayerSharing:
    """How a foreign decoder's own layer list runs shared blocks (set by :func:`share_layers`, kept unregistered on
    the holder as ``layer_sharing``): entry l of the list at ``path`` (below the holder) is block
    ``layer_to_block[l]``. The list stays registered under the model's own name, so parameter names are the model's;
    a shared block is registered once per layer, like a tied weight. A path, not the list: a copy of the holder (the
    gather an FSDP2 delinking makes) finds its own list."""

    path: str

    def relink(self, holder: nn.Module, blocks: list[nn.Module], layer_to_block: list[int]) -> None:
        """Make layer l run ``blocks[layer_to_block[l]]``; once every layer has its own block, the holder's
        ``blocks`` is the model's list itself again (a real model, declared like any foreign one)."""
        layers = holder.get_submodule(self.path)
        for layer, block in enumerate(layer_to_block):
            if layer < len(layers):
                layers[layer] = blocks[block]
            else:  # a shallow model grows
                layers.append(blocks[block])
        # Real: every layer its own block, at the full depth (a shallow pseudo model's layers are its own too).
        real = list(layer_to_block) == list(range(len(layers))) and len(layers) >= vars(holder).get("full_depth", 0)
        vars(holder)["blocks"] = layers if real else nn.ModuleList(blocks)  # an alias, never registered
        vars(holder)["layer_to_block"] = list(layer_to_block)
        if real:
            vars(holder).pop("layer_sharing", None)
            for layer, block in enumerate(layers):  # each layer its own index again (KV caches read it)
                for module in block.modules():
                    if isinstance(getattr(module, "layer_idx", None), int):
                        module.layer_idx = layer


# Attributes that number a layer rather than configure it (a shared block answers to its first layer's).
_POSITION_ATTRIBUTES = frozenset({"training", "layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})


def layer_difference(first: nn.Module, other: nn.Module) -> str | None:
    """What makes two decoder layers not interchangeable, or None: a parameter of another shape, or a plain setting
    (int, float, str, bool, None) of some submodule that differs, such as Qwen3's ``layer_type`` "sliding_attention"
    against "full_attention", or a sliding window on one layer only."""
    shapes = [(name, tuple(p.shape)) for name, p in first.named_parameters()]
    other_shapes = [(name, tuple(p.shape)) for name, p in other.named_parameters()]
    if shapes != other_shapes:
        return "their parameters have other names or shapes"
    for (name, a), (_, b) in zip(first.named_modules(), other.named_modules()):
        for key, value in vars(a).items():
            if key.startswith("_") or key in _POSITION_ATTRIBUTES or not isinstance(value, (int, float, str, bool,
                                                                                              type(None))):
                continue
            theirs = vars(b).get(key, value)
            if theirs != value:
                where = f"{name}.{key}" if name else key
                return f"{where} is {value!r} on one and {theirs!r} on the other"
    return None


def share_layers(holder: nn.Module, layers: nn.ModuleList, num_unique_blocks: int, sharing: str = "sequence"
                 ) -> None:
    """Turn a decoder whose ``holder`` runs the list ``layers`` into a pseudo model of ``num_unique_blocks`` blocks,
    in place: the layers that share block b (``sharing``: "sequence" or "cycle", as ``M6Config.sharing``) all run the
    module of the first of them, whose weights they keep. ``delink`` (and ``PseudoToReal``) later gives each layer its
    own copy again, keeping the function."""
    num_layers = len(layers)
    if not isinstance(layers, nn.ModuleList) or num_layers < 2:
        raise ValueError("share_layers needs the nn.ModuleList of the decoder's layers (at least two)")
    if num_unique_blocks < 1 or num_layers % num_unique_blocks:
        raise ValueError(f"num_unique_blocks={num_unique_blocks} must divide the decoder's {num_layers} layers")
    if sharing not in ("sequence", "cycle"):
        raise ValueError(f"sharing must be 'sequence' or 'cycle', got {sharing!r}")
    if "layer_sharing" in vars(holder) or len({id(layer) for layer in layers}) < num_layers:
        raise ValueError(f"{type(holder).__name__}'s layers already share blocks")
    layer_to_block = sharing_map(num_layers, num_unique_blocks, sharing)
    first_layer = {block: layer_to_block.index(block) for block in range(num_unique_blocks)}
    for layer, block in enumerate(layer_to_block):
        difference = layer_difference(layers[first_layer[block]], layers[layer])
        if difference:
            raise ValueError(f"share_layers: layer {layer} would run layer {first_layer[block]}'s block "
                             f"(sharing={sharing!r}) but the two differ: {difference}. Sharing would change the "
                             "model's function; choose num_unique_blocks or sharing so that only alike layers share "
                             "(e.g. 'sequence' for a model whose first and second halves differ)")
    blocks = [layers[first_layer[block]] for block in range(num_unique_blocks)]
    path = next((name for name, module in holder.named_modules() if module is layers), None)
    if not path:
        raise ValueError(f"share_layers: the layer list is not a submodule of {type(holder).__name__}")
    sharing_record = LayerSharing(path)
    vars(holder)["sharing"] = sharing
    vars(holder)["layer_sharing"] = sharing_record
    sharing_record.relink(holder, blocks, layer_to_block)


def shallow_layers(holder: nn.Module, layers: nn.ModuleList, num_layers: int, growth_init: str = "copy",
                   residual_outputs: tuple[str, ...] = ()) -> None:
    """Turn a decoder whose ``holder`` runs the list ``layers`` into a *shallow* pseudo model, in place: it keeps
    its first ``num_layers`` layers (their weights and names) and runs only those; ``delink`` (and ``PseudoToReal``)
    later grows it to the full depth by the cycle map (new layer i a copy of layer i mod ``num_layers``, G_stack's
    stacking), appending to the model's own list. ``growth_init="zero_outputs"`` zeroes the parameters of the
    gained layers whose names end with ``residual_outputs`` (the residual branches' last projections), so growth
    keeps the function."""
    depth = len(layers)
    if not isinstance(layers, nn.ModuleList) or depth < 2:
        raise ValueError("shallow_layers needs the nn.ModuleList of the decoder's layers (at least two)")
    if not 1 <= num_layers < depth or depth % num_layers:
        raise ValueError(f"a shallow pseudo model of {num_layers} layers must divide the decoder's {depth} "
                         "layers (and be fewer)")
    if growth_init not in ("copy", "zero_outputs"):
        raise ValueError(f"growth_init must be 'copy' or 'zero_outputs', got {growth_init!r}")
    if growth_init == "zero_outputs" and not residual_outputs:
        raise ValueError("growth_init='zero_outputs' needs the names of the residual branches' output projections "
                         "(DecoderParts.residual_outputs)")
    if "layer_sharing" in vars(holder) or len({id(layer) for layer in layers}) < depth:
        raise ValueError(f"{type(holder).__name__}'s layers already share blocks")
    for layer in range(num_layers, depth):  # the layers gained later copy these: they must be alike
        difference = layer_difference(layers[layer % num_layers], layers[layer])
        if difference:
            raise ValueError(f"shallow_layers: layer {layer} would be grown from layer {layer % num_layers} but the "
                             f"two differ: {difference}; choose a number of layers whose cycle maps alike layers")
    path = next((name for name, module in holder.named_modules() if module is layers), None)
    if not path:
        raise ValueError(f"shallow_layers: the layer list is not a submodule of {type(holder).__name__}")
    del layers[num_layers:]
    record = vars(holder)
    record.update(full_depth=depth, sharing="cycle", growth_init=growth_init,
                  residual_outputs=tuple(residual_outputs), layer_sharing=LayerSharing(path))
    record["layer_sharing"].relink(holder, list(layers), list(range(num_layers)))


def find_block_sequence(model: nn.Module) -> nn.Module:
    """The first submodule (the model itself included) that declares ``blocks`` and ``layer_to_block``."""
    for module in model.modules():
        if isinstance(getattr(module, "blocks", None), nn.ModuleList) and hasattr(module, "layer_to_block"):
            return module
    hint = ""
    if callable(getattr(model, "configure_model", None)):
        # A LightningModule builds its layers in configure_model (Lightning calls it at the start of fit).
        hint = (f"; {type(model).__name__} builds its model in configure_model(): call model.configure_model() "
                "first, or delink from a callback once training has started")
    raise ValueError(
        f"{type(model).__name__} has no block sequence: delinking and the strategy need a submodule with "
        f"`blocks` (an nn.ModuleList) and `layer_to_block` (a list mapping each layer to its block){hint}"
    )


# Output projections of the residual branches: zeroed on the layers a shallow model gains with growth_init=
# "zero_outputs", so each such layer adds nothing to the residual stream at first.
_RESIDUAL_OUTPUTS = ("attn.out.weight", "attn.out.bias", "fc_out.weight", "fc_out.bias", "experts.w_out")


def full_depth(holder: nn.Module) -> int:
    """The real model's depth: the holder's ``full_depth`` if it declares one (a shallow pseudo model), else the
    number of layers it runs."""
    return int(getattr(holder, "full_depth", len(holder.layer_to_block)))


def shared_experts(holder: nn.Module) -> list[nn.Module]:
    """The expert modules of the block sequence whose experts still share FFNs (to be upcycled)."""
    return [module for module in holder.blocks.modules() if getattr(module, "is_shared", False) is True]


def check_delink_target(num_layers: int, current: int, target: int | None) -> int:
    """Resolve and validate the number of blocks after delinking; raise ValueError explaining what is wrong."""
    target = num_layers if target is None else target
    if current == num_layers:
        raise ValueError(f"the model is already real: each of its {num_layers} layers has its own block")
    if not 1 <= target <= num_layers or num_layers % target:
        raise ValueError(f"num_unique_blocks={target} must divide num_layers={num_layers}")
    if target <= current or target % current:
        raise ValueError(
            f"num_unique_blocks={target} must be a multiple of the current {current} blocks (and larger): "
            "delinking only splits shared blocks"
        )
    return target


def new_layout(layer_to_block: list[int], target: int, layout: str) -> tuple[list[int], list[int]]:
    """The sharing map after delinking into ``target`` blocks in ``layout`` ("sequence" or "cycle"), and for each
    new block the old block it is copied from.

    Every new block's layers must all have run a single old block, or the copies could not reproduce the function.
    """
    new_map = sharing_map(len(layer_to_block), target, layout)
    sources = []
    for new in range(target):
        layers = [layer for layer, block in enumerate(new_map) if block == new]
        olds = {layer_to_block[layer] for layer in layers}
        if len(olds) != 1:
            raise ValueError(
                f"layer_to_block {layer_to_block} cannot be delinked into {target} blocks in the {layout!r} layout "
                f"and keep its function: layers {layers} would share a new block but run blocks {sorted(olds)}")
        sources.append(olds.pop())
    return new_map, sources


@torch.no_grad()
def delink(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    num_unique_blocks: int | None = None,
    optimizer_state: OptimizerStatePolicy | MeasuredSecondMoments = "scale",
    perturb: Perturbation | None = None,
) -> torch.optim.Optimizer | None:
    """Give shared blocks their own copies, in place, keeping the function exactly.

    A shallow pseudo model (the holder's ``full_depth`` exceeds the layers it runs) is *grown* instead: new layer i
    runs a copy of block i mod U, which changes the function unless the holder's ``growth_init`` is "zero_outputs".
    Experts that share an FFN are upcycled into one copy each (see the module docstring); a model whose blocks are
    real already but whose experts are shared is upcycled only.

    Args:
        model: a module containing a block sequence (see the module docstring).
        optimizer: the optimizer over ``model``'s parameters, or None. It is not modified.
        num_unique_blocks: blocks after delinking; None means one per layer (the real model). Must divide the
            number of layers and be a multiple of the current number of blocks (staged delinking: 1 -> 2 -> 4).
        optimizer_state: what each copy's per-parameter state becomes: "scale" (moments divided by the number of
            copies, squared for second moments), "copy" (unchanged), "reset" (fresh), or a
            :class:`MeasuredSecondMoments` (the "per_layer" policy: second moments from the layers' own gradients;
            the string "per_layer" alone, without a measurement, falls back to "scale").

    Returns:
        A new optimizer of the same class and hyperparameters over the new parameters, with state carried over,
        or None when no optimizer was given. Parameter groups list parameters in ``model.parameters()`` order,
        so a fresh ``configure_optimizers`` on the delinked model orders them the same way (checkpoints match).
    """
    if not isinstance(optimizer_state, MeasuredSecondMoments) and optimizer_state not in POLICIES:
        raise ValueError(f"optimizer_state must be one of {', '.join(map(repr, POLICIES))} or a "
                         f"MeasuredSecondMoments, got {optimizer_state!r}")
    if optimizer is not None and type(optimizer) not in SUPPORTED_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in SUPPORTED_OPTIMIZERS)
        raise ValueError(f"delink cannot carry the state of {type(optimizer).__name__}; supported: {names}")
    holder = find_block_sequence(model)
    layer_to_block = list(holder.layer_to_block)
    current = len(holder.blocks)
    depth = full_depth(holder)
    shallow = depth > len(layer_to_block)
    upcycle = bool(shared_experts(holder))
    if upcycle and current == depth:
        target = current  # the blocks are real already: upcycle the experts only
    else:
        target = check_delink_target(depth, current, num_unique_blocks)
    copies_per_block = target // current
    if isinstance(optimizer_state, MeasuredSecondMoments) and (shallow or upcycle):
        raise ValueError("optimizer_state='per_layer' measures shared layers' gradients: it cannot carry state into "
                         "a growing (shallow) model or upcycled experts; use 'scale'")

    # Remember where every parameter came from, by name, before the structure changes.
    # The holder's layout ("sequence" unless it says otherwise) is kept; validated before anything changes.
    if shallow:
        if layer_to_block != list(range(current)):
            raise ValueError(f"a shallow pseudo model runs block i at layer i; got layer_to_block {layer_to_block}")
        # Growth by the cycle map: new layer (and block) i is a copy of block i mod current.
        new_map, sources = list(range(target)), [block % current for block in range(target)]
    else:
        new_map, sources = new_layout(layer_to_block, target, getattr(holder, "sharing", "sequence"))
    foreign = vars(holder).get("layer_sharing") is not None
    prefix = _prefix_of(model, holder)
    old_params = dict(model.named_parameters(remove_duplicate=False))
    new_blocks: list[nn.Module] = []
    used: set[int] = set()
    for source in sources:
        block = holder.blocks[source]
        # The first copy keeps the original module; the others are exact deep copies.
        new_blocks.append(block if source not in used else copy.deepcopy(block))
        used.add(source)
    # Tensors whose optimizer state starts afresh (zeroed outputs, a re-drawn router), by identity. The set holds the
    # tensors, not their ids: upcycling frees replaced tensors, and a freed tensor's id is reused by the next one made.
    fresh = IdentitySet()
    if shallow and target > current and getattr(holder, "growth_init", "copy") == "zero_outputs":
        outputs = tuple(getattr(holder, "residual_outputs", None) or _RESIDUAL_OUTPUTS)  # a foreign decoder's own
        for block in new_blocks[current:]:
            for name, param in block.named_parameters():
                if name.endswith(outputs):
                    param.zero_()
                    fresh.add(param)
    layer_sharing = vars(holder).get("layer_sharing")
    if layer_sharing is not None:  # a foreign decoder: its own layer list takes the copies, names unchanged
        layer_sharing.relink(holder, new_blocks, new_map)
    else:
        holder.blocks = nn.ModuleList(new_blocks)
        holder.layer_to_block = new_map
    upcycled = _upcycle(holder, perturb, fresh) if upcycle else {}
    if perturb is not None and perturb.relative_scale > 0:
        # Seeded by the name inside the block sequence, which is the same in every layout (a sharded model is
        # delinked as a plain copy of a submodule, whose names lack the outer prefix).
        for name, param in holder.blocks.named_parameters(prefix="blocks"):
            _add_relative_noise(param, perturb, name)

    if optimizer is None:
        return None
    origin = {}
    for name, param in model.named_parameters():
        # A foreign decoder names its blocks by layer: a layer that existed ran its block under its own name (the
        # duplicates of a shared block included); a layer a shallow model gained copies layer i mod current.
        known = old_params.get(name) if foreign else None
        origin[param] = known if known is not None else old_params[_source_name(name, prefix, sources)]
    ratios = {}
    if isinstance(optimizer_state, MeasuredSecondMoments):
        # Named inside the block sequence, like the noise: the same names in every layout and placement.
        ratios = {param: optimizer_state.ratios[name] for name, param in holder.blocks.named_parameters(prefix="blocks")
                  if name in optimizer_state.ratios}
    # A shallow model's block ran once per step before and each copy runs once after: its gradient scale does not
    # change, so "scale" divides a split block's moments by 1 there (by the number of copies for shared depth).
    return _rebuild_optimizer(optimizer, model, origin, 1 if shallow else copies_per_block, optimizer_state, ratios,
                              upcycled, fresh)


def _upcycle(holder: nn.Module, perturb: Perturbation | None, fresh: IdentitySet) -> dict[int, int]:
    """Give every expert of each shared expert module its own copy of the FFN it ran (sparse upcycling). Returns,
    per new expert tensor's id, how many experts shared each FFN before (its gradient was their sum)."""
    config = getattr(holder, "config", None)
    router_policy = getattr(config, "upcycle_router", "keep")
    noise = float(getattr(config, "upcycle_noise", 0.0))
    drop = float(getattr(config, "upcycle_drop", 0.0))
    seed = perturb.seed if perturb is not None else 0  # the noise's and the drop's draws
    copies_of: dict[int, int] = {}
    for index, block in enumerate(holder.blocks):
        for module_name, module in block.named_modules():
            if getattr(module, "is_shared", False) is not True:
                continue
            copies = module.num_experts // module.num_unique
            for name in ("w_in", "w_out"):
                shared = getattr(module, name)
                grown = nn.Parameter(shared.detach().repeat(copies, 1, 1))
                setattr(module, name, grown)
                copies_of[id(grown)] = copies
                if shared in fresh:  # a zeroed output projection stays fresh after upcycling
                    fresh.add(grown)
                if noise > 0:
                    _add_relative_noise(grown, Perturbation(noise, seed), f"blocks.{index}.{module_name}.{name}")
            if drop > 0:
                _drop_upcycle(module, drop, parameter_seed(seed, f"blocks.{index}.{module_name}@drop"))
            module.num_unique = module.num_experts
            router = getattr(getattr(block, "ffn", None), "router", None)
            if router_policy == "reinit" and router is not None:
                rule = getattr(block, "init_rule", None)
                if rule is not None:  # a new draw of the init distribution (not the values the run started from)
                    rule.fill_(f"{getattr(block, 'name_in_model', f'blocks.{index}.')}ffn.router.weight@upcycled",
                               router.weight)
                else:
                    nn.init.normal_(router.weight, std=0.02)
                fresh.add(router.weight)
    if config is not None and hasattr(config, "num_unique_experts"):
        config.num_unique_experts = None  # keep the config truthful: every expert has its own FFN now
    return copies_of


def _drop_upcycle(experts: nn.Module, fraction: float, seed: int) -> None:
    """Drop-Upcycling, in place on freshly upcycled (equal) expert copies: in each expert, a random ``fraction`` of
    the hidden units (columns of ``w_in`` (experts, dim, hidden), rows of ``w_out`` (experts, hidden, dim)) re-drawn
    from a normal distribution with the shared weights' mean and standard deviation. Seeded (the same draw in every
    layout); each expert draws its own units."""
    w_in, w_out = experts.w_in, experts.w_out
    hidden = w_in.shape[2]
    dropped = round(fraction * hidden)
    if dropped == 0:
        return
    generator = torch.Generator().manual_seed(seed)
    (mean_in, std_in), (mean_out, std_out) = [(float(w.detach()[0].float().mean()), float(w.detach()[0].float().std()))
                                              for w in (w_in, w_out)]
    for expert in range(w_in.shape[0]):
        units = torch.randperm(hidden, generator=generator)[:dropped]
        fresh_in = torch.randn(w_in.shape[1], dropped, generator=generator) * std_in + mean_in
        fresh_out = torch.randn(dropped, w_out.shape[2], generator=generator) * std_out + mean_out
        on = units.to(w_in.device)
        w_in.data[expert][:, on] = fresh_in.to(w_in.device, w_in.dtype)
        w_out.data[expert][on, :] = fresh_out.to(w_out.device, w_out.dtype)


def _add_relative_noise(param: torch.Tensor, perturb: Perturbation, name: str) -> None:
    generator = torch.Generator().manual_seed(parameter_seed(perturb.seed, name))
    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
    rms = param.detach().float().square().mean().sqrt().cpu()
    param.add_((noise * (perturb.relative_scale * rms)).to(param.device, param.dtype))


def _prefix_of(model: nn.Module, holder: nn.Module) -> str:
    """Where the blocks' parameter names start: the holder's ``blocks``, or a foreign decoder's own layer list."""
    layer_sharing = vars(holder).get("layer_sharing")
    inner = layer_sharing.path if layer_sharing is not None else "blocks"
    for name, module in model.named_modules():
        if module is holder:
            return f"{name}.{inner}." if name else f"{inner}."
    raise AssertionError("the block sequence is a submodule of the model")


def _source_name(name: str, prefix: str, sources: list[int]) -> str:
    """Map a parameter name of the delinked model to the name of the parameter it was copied from."""
    if not name.startswith(prefix):
        return name
    index, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{sources[int(index)]}.{rest}"


def optimizer_constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults that its constructor accepts: enough to build another of the same kind."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def _rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    origin: dict[nn.Parameter, nn.Parameter],
    copies: int,
    policy: OptimizerStatePolicy | MeasuredSecondMoments,
    ratios: dict[nn.Parameter, torch.Tensor],
    upcycled: dict[int, int] | None = None,
    fresh: IdentitySet | None = None,
) -> torch.optim.Optimizer:
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    new_groups = [{key: value for key, value in group.items() if key != "params"} | {"params": []}
                  for group in optimizer.param_groups]
    for param in _unique(model.parameters()):
        source = origin[param]
        if id(source) in group_of:
            new_groups[group_of[id(source)]]["params"].append(param)
    # Parameters the optimizer held that are not in the model (rare) stay where they were.
    # Tensors replaced by upcycling (the shared expert weights) left the model: they leave the optimizer too.
    in_model = {id(p) for p in model.parameters()} | {id(source) for source in origin.values()}
    for index, group in enumerate(optimizer.param_groups):
        new_groups[index]["params"].extend(p for p in group["params"] if id(p) not in in_model)

    new_optimizer = type(optimizer)(new_groups, **optimizer_constructor_kwargs(optimizer))
    # A block that was split: its original tensor (kept by the first copy) and every new copy.
    split_ids = {id(t) for param, source in origin.items() if param is not source for t in (param, source)}
    for group in new_optimizer.param_groups:
        for param in group["params"]:
            source = origin.get(param, param)
            state = optimizer.state.get(source)
            if not state or (fresh is not None and param in fresh):
                continue
            expert_copies = (upcycled or {}).get(id(param), 1)
            is_split = id(param) in split_ids or expert_copies > 1
            if is_split and policy == "reset":
                continue
            scaled = is_split and policy not in ("copy", "reset")  # scale, per_layer (measured or not)
            divisor = (copies if id(param) in split_ids else 1) * expert_copies
            new_optimizer.state[param] = _carry_state(state, divisor if scaled else 1,
                                                      ratios.get(param) if is_split else None, expert_copies)
    return new_optimizer


def _carry_state(state: dict, copies: int, second_moment_ratio: torch.Tensor | None = None,
                 repeat: int = 1) -> dict:
    carried = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and repeat > 1 and value.dim() == 3:
            value = value.repeat(repeat, 1, 1)  # an upcycled expert tensor: each expert starts from the shared state
        if not isinstance(value, torch.Tensor):
            carried[key] = value
        elif key in _LINEAR_STATE:
            carried[key] = value / copies
        elif key in _QUADRATIC_STATE and second_moment_ratio is not None:
            carried[key] = value * second_moment_ratio.to(value.device, value.dtype)
        elif key in _QUADRATIC_STATE:
            carried[key] = value / copies**2
        else:
            carried[key] = value.clone()  # step counters and anything else: unchanged
    return carried


def _unique(params: Iterator[nn.Parameter]) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            yield param


def rebind_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """The same schedule, at the same step, driving ``optimizer`` (whose groups match the old optimizer's).

    A shallow copy keeps the schedule's own state (``last_epoch``, base LRs, the LR function) so the curve
    continues from the current step with no warmup restart.
    """
    if len(optimizer.param_groups) != len(scheduler.optimizer.param_groups):
        raise ValueError("the new optimizer must have as many parameter groups as the scheduler's optimizer")
    rebound = copy.copy(scheduler)
    rebound.optimizer = optimizer
    silence_rebound_scheduler_notice()  # torch's "optimizer.step() overridden" check does not apply here
    # Composite schedulers (SequentialLR, ChainedScheduler) drive the optimizer through their children.
    children = getattr(scheduler, "_schedulers", None)
    if isinstance(children, list):
        rebound._schedulers = [rebind_scheduler(child, optimizer) for child in children]
    return rebound
