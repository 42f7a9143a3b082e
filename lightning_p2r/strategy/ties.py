"""Shared parameters (a tied embedding and LM head, any tie a user makes) kept as one parameter in every layout.

A tie is one ``nn.Parameter`` registered under several names. Each layout step that swaps parameters (FSDP2's
``fully_shard``, tensor parallelism's styles) swaps the registrations it can see; a registration it cannot see keeps
the old tensor and trains on its own, silently (issue 38: GPT-2's head under ``sharding="zero3"``). So placement
chooses its FSDP2 roots to hold every registration, refuses what no layout step can keep tied, and checks after
placing that every tie still holds. Ties are keyed by parameter name (never by attributes on parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

Tie = tuple[str, ...]
"""The names under which one parameter is registered (relative to the module they were read from), in
``named_parameters`` order: the first is the parameter's own name in checkpoints."""


def find_ties(module: nn.Module) -> list[Tie]:
    """Every parameter of ``module`` registered under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def registrations(module: nn.Module) -> int:
    """How many (module, name) registrations of parameters ``module``'s subtree has (a tie counts each one)."""
    return sum(1 for _ in module.named_parameters(remove_duplicate=False))


def smallest_parameter_root(module: nn.Module) -> nn.Module:
    """The deepest submodule holding every *registration* of every parameter of ``module`` (the FSDP2 root in
    standard mode). A tied head outside the submodule that holds the embedding (Hugging Face's ``lm_head`` beside
    ``model``) pulls the root up to their common parent, so ``fully_shard`` swaps both names. Sharding the
    LightningModule itself would change its class, which Lightning's hook checks look at: the root stays below it
    whenever a child holds everything."""
    total = registrations(module)
    current = module
    while True:
        for child in current.children():
            if registrations(child) == total:
                current = child
                break
        else:
            return current


def placement_root(module: nn.Module, holder: nn.Module) -> nn.Module:
    """The module placement shards and delinking rebuilds: :func:`smallest_parameter_root`, raised to ``holder`` (the
    module declaring the block sequence) when it lies below it. A pipeline rank without the head holds its parameters
    below a Hugging Face causal LM, which declares the blocks; delinking a copy of the root must find them."""
    root = smallest_parameter_root(module)
    if holder is not module and root is not holder and any(m is root for m in holder.modules()):
        return holder
    return root


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _innermost(name: str, units: Mapping[str, str]) -> str | None:
    """The label of the deepest unit (by its name prefix) that contains parameter ``name``, or None (the root)."""
    best: tuple[int, str] | None = None
    for prefix, label in units.items():
        if name.startswith(prefix + ".") and (best is None or len(prefix) > best[0]):
            best = (len(prefix), label)
    return best[1] if best is not None else None


def tie_remedy(sharding: str, offloading: bool, layered: bool) -> str:
    """What else trains a model with a tie across blocks, for :func:`check_ties_within_units`'s message: ZeRO-2/3
    alone can fall back to a replicated layout, which DDP's reducer runs; offload or layered accumulation across
    processes wraps every block in FSDP2 whatever the sharding."""
    if sharding in ("zero2", "zero3") and not offloading and not layered:
        return "or use sharding='none'/'zero1'"
    return ("or train without offload and layered accumulation across processes (sharding='none'/'zero1': DDP's "
            "reducer keeps any tie)")


def check_ties_within_units(root: nn.Module, units: Iterable[nn.Module], what: str,
                            remedy: str = "or use sharding='none'/'zero1'") -> None:
    """Refuse a tie whose registrations lie in different FSDP2 units (or some in a unit, some in the root): each unit
    shards only its own registrations, so the others would keep a separate, unsynchronized copy. ``units``: the
    modules ``fully_shard`` will wrap, all inside ``root``; ``what``: the options that asked for them; ``remedy``:
    the layout change that avoids them (:func:`tie_remedy`)."""
    wanted = {id(unit) for unit in units}
    label: dict[int, str] = {}  # a unit registered under two names (``model.blocks = model.layers``) is one unit
    prefixes = {name: label.setdefault(id(m), name)
                for name, m in root.named_modules(remove_duplicate=False) if id(m) in wanted and name}
    for tie in find_ties(root):
        homes = {name: _innermost(name, prefixes) for name in tie}
        if len(set(homes.values())) > 1:
            where = ", ".join(f"{name} (in {home or 'the root'})" for name, home in homes.items())
            raise ValueError(
                f"P2RStrategy({what}) cannot keep a tie across FSDP2 units: one parameter is registered as {where}; "
                "each unit shards its own registrations and the others would train apart. Keep tied modules inside "
                f"one block, or outside every block (the embedding and head are), {remedy}")


def check_tensor_parallel_ties(root: nn.Module, planned: Mapping[str, str]) -> None:
    """Refuse a tie that tensor parallelism would cut apart. ``planned``: module name (relative to ``root``) -> split
    kind. A tied weight is split as one tensor only when every module holding it splits it the same way along the
    vocabulary (an embedding by "vocabulary" rows and a head by "output" columns both cut dim 0)."""
    for tie in find_ties(root):
        # A module registered under several names (a pseudo model's block at several layers) is split once, for all
        # of them: only names held by different modules can be cut apart.
        holders: dict[int, str] = {}
        for name in tie:
            holders.setdefault(id(root.get_submodule(_owner(name))), name)
        if len(holders) < 2:
            continue
        kinds = {name: planned.get(_owner(name)) for name in holders.values()}
        split = {name: kind for name, kind in kinds.items() if kind is not None}
        if not split:
            continue
        if len(split) < len(kinds) or not set(split.values()) <= {"vocabulary", "output"}:
            where = ", ".join(f"{name} ({kind or 'not split'})" for name, kind in kinds.items())
            raise ValueError(
                f"P2RStrategy(tensor_parallel > 1) would untie a shared parameter: it is registered as {where}. "
                "Split every module holding it by the vocabulary (the embedding 'vocabulary', the head 'output'), "
                "or none of them")


def check_offloaded_blocks_untied(holder: nn.Module, offloaded: Iterable[int]) -> None:
    """Refuse an offloaded block whose parameters another block or a module outside the blocks also holds: between
    the block's layers its parameters are empty placeholders (their values in host memory), so the other holder would
    read no data, and the block's host masters would miss that holder's gradients. ``holder``: the block sequence's
    holder; a registration is seen under every name (``named_modules(remove_duplicate=False)``), so a block's
    submodule registered again outside the blocks (``model.final_norm = model.layers[-1].norm``) is found too. A
    whole block registered under a second name (``model.final_layer = model.layers[-1]``) is still that block: its
    forward streams it wherever it is called (and calls out of layer order are refused when they happen)."""
    offloaded = set(offloaded)
    owners: dict[int, int] = {}
    for index, block in enumerate(holder.blocks):
        for param in block.parameters():
            first = owners.setdefault(id(param), index)
            if first != index and (index in offloaded or first in offloaded):
                raise ValueError(f"blocks {first} and {index} share a parameter; P2RStrategy cannot offload a block "
                                 "whose parameters are tied to another block (offload neither, with offload_blocks, "
                                 "or give each block its own module)")
    # Every name under which each offloaded block is registered (a pseudo model's block at several layers, an alias).
    by_id = {id(holder.blocks[index]): index for index in offloaded}
    block_names: dict[int, list[str]] = {}
    for name, module in holder.named_modules(remove_duplicate=False):
        if id(module) in by_id:
            block_names.setdefault(by_id[id(module)], []).append(name)
    for name, module in holder.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            index = owners.get(id(param))
            if index is None or index not in offloaded:
                continue
            names = block_names.get(index, [])
            if any(name == home or name.startswith(home + ".") for home in names):
                continue
            inside = next((f"{home}.{inner}" if inner else home for home in names
                           for inner, m in holder.blocks[index].named_modules() if m is module), None)
            what = f"module {name!r} is {inside!r} of offloaded block {index}, registered again outside the blocks" \
                if inside else f"module {name!r} holds {param_name!r}, a parameter of offloaded block {index}"
            raise ValueError(
                f"P2RStrategy cannot offload a block whose parameters a module outside the blocks also holds: {what} "
                f"(between the block's layers its parameters are empty placeholders, their values in host memory). "
                f"Reach it through the block only (not as {type(holder).__name__}.{name}), or keep block {index} on "
                f"the device: offload_blocks without {index}")


def retie(root: nn.Module, ties: Iterable[Tie]) -> None:
    """Point every name of each tie at the parameter its first name holds now (after a step that swapped it)."""
    for first, *others in ties:
        param = root.get_parameter(first)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(root.get_submodule(owner), attribute, param)


def check_ties_kept(root: nn.Module, ties: Iterable[Tie]) -> None:
    """After placement: every tie recorded before it still names one parameter (a guard: a break is a bug here)."""
    for tie in ties:
        if len({id(root.get_parameter(name)) for name in tie}) > 1:
            raise RuntimeError(f"P2RStrategy untied {', '.join(tie)} while placing the model: please report this")
