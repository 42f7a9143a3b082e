"""Which of a model's modules are its blocks, for a model that does not call them ``blocks`` (issue 38, item 2).

Offload, sharding, layered accumulation and pipelines work per block, on the *block sequence* contract
(``protocols.BlockSequence``: a holder with ``blocks`` and ``layer_to_block``). The package's models declare it. A
Hugging Face or litgpt model keeps its own names (``model.layers``, ``transformer.h``): the strategy is told the block
list by a dotted path (``P2RStrategy(blocks="model.model.layers")``) or finds it, as FSDP's transformer auto-wrap policy
finds its layer class, and declares the contract on the module whose ``forward`` runs the blocks. The declaration is an
unregistered alias (``vars(holder)["blocks"]``): the list stays registered once, under the model's own name, so state
dicts and checkpoints keep exactly the model's parameter names.

A wrong choice would be silent for some layouts, so the first training forward records which blocks ran, in which
order, and refuses a holder whose forward never ran or blocks called out of order (``BlockCallCheck``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from ..models.module_init import is_hf_pretrained
from ..protocols import NamesBlockHolder, NamesBlockList

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def module_name(root: nn.Module, target: nn.Module) -> str:
    """``target``'s registered name under ``root`` ("" for ``root`` itself): a declared block list is found under the
    model's own name (``model.layers``), never under the ``blocks`` alias, which is not registered."""
    for name, module in root.named_modules():
        if module is target:
            return name
    raise ValueError(f"{type(target).__name__} is not part of {type(root).__name__}")


def _registered_name(holder: nn.Module, target: nn.Module) -> str | None:
    return next((name for name, module in holder.named_modules() if module is target), None)


def block_names(holder: nn.Module) -> list[str]:
    """Each declared block's registered name under ``holder``: ``model.layers.3``; for a pseudo model's block, run at
    several layers, the first layer's (the unique blocks' list is an alias, not registered)."""
    listed = _registered_name(holder, holder.blocks)
    if listed is not None:  # by position (a pipeline rank's stand-ins need not be distinct objects)
        return [f"{listed}.{index}" if listed else str(index) for index in range(len(holder.blocks))]
    names = [_registered_name(holder, block) for block in holder.blocks]
    if all(names):
        return names
    # A pipeline rank's stand-ins for the blocks other ranks hold are not in the model: each is named at the first
    # layer running it (the model's list holds block b first there), in the list a held block is registered in.
    found = next((name for name in names if name), None)
    layers = getattr(holder, "layer_to_block", None)
    if found is None or layers is None:
        return [module_name(holder, block) for block in holder.blocks]  # refused there, naming the first missing
    list_name, layers = found.rpartition(".")[0], list(layers)
    return [name or (f"{list_name}.{layers.index(block)}" if list_name else str(layers.index(block)))
            for block, name in enumerate(names)]


def block_list_name(holder: nn.Module) -> str:
    """The registered name of the list holding ``holder``'s declared blocks: the list itself, or, for a pseudo model
    whose unique blocks are an unregistered alias, the layers list running them."""
    listed = _registered_name(holder, holder.blocks)
    return listed if listed is not None else block_names(holder)[0].rpartition(".")[0]


@dataclass(frozen=True)
class DeclaredBlocks:
    """Where a model's block list is and who runs it."""

    path: str
    """Dotted name of the block list, from the LightningModule."""
    holder_path: str
    """Dotted name of the module whose ``forward`` runs the blocks ("" for the LightningModule itself)."""
    detected: bool
    """True when the strategy chose the list (no ``blocks=`` given)."""
    size: int
    kind: str
    """The blocks' class name."""
    named_by: str = ""
    """Who named the list when no ``blocks=`` was given: the module's ``block_list()`` (``"CausalLMModule"``)."""

    def describe(self) -> str:
        # Said apart: the option given, the module's own block_list() (CausalLMModule: the user gave nothing), or
        # detection. A list named by the module read "as given" until 2026-12-02, with no blocks= given.
        if self.detected:
            how = "detected (pass blocks='...' to choose another)"
        elif self.named_by:
            how = f"named by {self.named_by}.block_list() (pass blocks='...' to choose another)"
        else:
            how = "as given (blocks=)"
        return f"P2RStrategy blocks: {self.path} ({self.size} x {self.kind}), {how}"


def block_lists(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``nn.ModuleList`` of at least two modules of one class, or of classes a Hugging Face model inside names
    in its ``_no_split_modules`` (Jamba alternates Mamba and attention layers), each once, under its first name: the
    candidates for a model's block list."""
    unsplit = {name for child in module.modules() for name in (getattr(child, "_no_split_modules", None) or ())}
    seen: set[int] = set()
    found = []
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) > 1 and id(child) not in seen:
            seen.add(id(child))
            if len({type(block) for block in child}) == 1 or all(
                    unsplit.intersection(cls.__name__ for cls in type(block).__mro__) for block in child):
                found.append((name, child))
    return found


HOW_TO_DECLARE = ("hold the blocks in one nn.ModuleList that a module's forward runs in order, and name it if the "
                  "strategy does not take it: P2RStrategy(blocks='<dotted path>'), or the LightningModule's "
                  "block_list() returning that path (protocols.NamesBlockList; block_holder() names the module whose "
                  "forward runs it where that is not the list's parent; docs/your_model.md, 'Which modules are the "
                  "blocks')")


def _contents(container: nn.Module) -> str:
    counts: dict[str, int] = {}
    for child in container.children():
        counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    return ", ".join(f"{count} x {kind}" for kind, count in counts.items()) or "nothing"


def why_not_blocks(module: nn.Module, limit: int = 8) -> list[str]:
    """Each container (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``) in ``module``, under its first name,
    with why :func:`detect_block_list` does not take it as the block list (the first ``limit``, then a count)."""
    unsplit = {name for child in module.modules() for name in (getattr(child, "_no_split_modules", None) or ())}
    seen: set[int] = set()
    reasons = []
    for name, child in module.named_modules():
        if not isinstance(child, _CONTAINERS) or id(child) in seen:
            continue
        seen.add(id(child))
        what = f"{name or type(module).__name__} ({type(child).__name__} of {_contents(child)})"
        inside = _inside_a_list(name, module) if name else None
        if inside is not None:
            reasons.append(f"{what}: inside the list {inside}, so a block's own list")
        elif not isinstance(child, nn.ModuleList):
            reasons.append(f"{what}: not an nn.ModuleList")
        elif len(child) < 2:
            reasons.append(f"{what}: fewer than two modules")
        elif len({type(block) for block in child}) > 1 and not all(
                unsplit.intersection(cls.__name__ for cls in type(block).__mro__) for block in child):
            reasons.append(f"{what}: modules of different classes")
    if len(reasons) > limit:
        reasons = reasons[:limit] + [f"and {len(reasons) - limit} more"]
    return reasons


def no_block_list_message(module: nn.Module) -> str:
    """Why no block list was found in ``module`` (a LightningModule): the containers looked at, each with why it was
    not taken, and how to declare one."""
    reasons = why_not_blocks(module)
    looked = ("it looked at " + "; ".join(reasons)) if reasons else \
        "it has no nn.ModuleList, nn.Sequential or nn.ModuleDict"
    return (f"P2RStrategy places a model block by block and found no block list in {type(module).__name__}: "
            f"{looked}. To train it, {HOW_TO_DECLARE}")


def _inside_a_list(name: str, module: nn.Module) -> str | None:
    """The name of the innermost ``nn.ModuleList`` of several modules that holds the module called ``name`` (its own
    list excluded), or None."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:end])
        container = module.get_submodule(outer)
        if isinstance(container, nn.ModuleList) and len(container) > 1:
            return outer
    return None


def detect_block_list(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest candidate list (a transformer's layers outnumber any other list of equal modules, such as experts),
    the outermost on a tie of length; None when the model has no candidate. A list inside another list of modules
    (a layer's experts, inside the layers) is a block's own list, never the block list: with layers of several classes
    (dense and MoE) it was once taken instead of them. Two outermost lists of the longest length (an encoder and a
    decoder) are ambiguous: refused, naming them."""
    candidates = [(name, blocks) for name, blocks in block_lists(module) if _inside_a_list(name, module) is None]
    if not candidates:
        return None
    longest = max(len(blocks) for _, blocks in candidates)
    best = [(name, blocks) for name, blocks in candidates if len(blocks) == longest]
    outer = [(name, blocks) for name, blocks in best if not any(name.startswith(other + ".") for other, _ in best)]
    if len(outer) > 1:
        raise ValueError(f"P2RStrategy cannot tell which list holds {type(module).__name__}'s blocks: "
                         f"{[name for name, _ in outer]} are equally long; name one with P2RStrategy(blocks='<dotted "
                         "path>') or the LightningModule's block_list() (protocols.NamesBlockList; "
                         "the other list's modules then stay outside the blocks: not offloaded, sharded or staged "
                         "per block), or hold all the blocks in one nn.ModuleList")
    return outer[0]


def _holder_path(path: str, module: nn.Module) -> str:
    """The nearest ancestor of the list at ``path`` that is not a container (whose ``forward`` runs the blocks), or,
    when that ancestor is the base model of a task model around it (a Hugging Face ``XForCausalLM`` whose
    ``base_model`` is the ``XModel`` running the layers), the task model: it holds the head, whose tensor-parallel
    plan entry (the class's ``_tp_plan``) and tie to the embedding belong to the same declaration as the blocks,
    as ``CausalLMModule.block_holder`` names it."""
    parts = path.split(".")[:-1]
    while parts and isinstance(module.get_submodule(".".join(parts)), _CONTAINERS):
        parts.pop()
    while parts:
        parent = module.get_submodule(".".join(parts[:-1]))
        # Only a Hugging Face task model's base_model: a user's module may name an attribute so for another reason.
        if not is_hf_pretrained(parent) or getattr(parent, "base_model", None) is not module.get_submodule(
                ".".join(parts)):
            break
        parts.pop()
    return ".".join(parts)


def named_block_list(module: nn.Module, option: str | None) -> tuple[str | None, str | None]:
    """(block list, holder) as dotted paths from ``module`` (a LightningModule): ``P2RStrategy(blocks=...)``'s
    ``option``, else the module's ``block_list()`` (``protocols.NamesBlockList``) with its ``block_holder()`` if it
    has one (None: the list's nearest ancestor that is not a container), else (None, None): detected. A
    ``block_list()`` without ``block_holder()`` once went unseen (the protocol required both) and detection took
    another list."""
    if option is not None or not isinstance(module, NamesBlockList):
        return option, None
    return module.block_list(), module.block_holder() if isinstance(module, NamesBlockHolder) else None


def declares_own_blocks(module: nn.Module) -> bool:
    """Whether ``module`` has a registered submodule ``blocks`` (a list) and ``layer_to_block``: the model's own
    block-sequence contract (``protocols.BlockSequence``), as opposed to one this module declared (an unregistered
    alias)."""
    blocks = getattr(module, "blocks", None)
    return isinstance(blocks, nn.ModuleList) and "blocks" not in vars(module) and hasattr(module, "layer_to_block")


def declare_blocks(module: nn.Module, path: str | None, holder_path: str | None = None, *,
                   named_by: str = "") -> DeclaredBlocks | None:
    """Declare the block-sequence contract on ``module`` (a LightningModule) for the list at ``path``, or the one
    detected; None when the model declares it itself (and no ``path`` is given) or has no candidate list (the
    engines then refuse it by name). ``holder_path``: the module to declare it on (an ancestor of the list whose
    forward runs the blocks); by default the nearest one that is not a container. Idempotent: a second call (after a
    resume, another fit) changes nothing. ``named_by``: the module class whose ``block_list()`` gave ``path`` (for the
    log line; empty when ``P2RStrategy(blocks=...)`` gave it)."""
    detected = path is None
    if path is None:
        if any(declares_own_blocks(m) for m in module.modules()):
            return None  # the model's own contract
        found = detect_block_list(module)
        if found is None:
            return None
        path, blocks = found
    else:
        try:
            blocks = module.get_submodule(path)
        except AttributeError:
            names = [name for name, _ in block_lists(module)]
            raise ValueError(f"P2RStrategy(blocks={path!r}): {type(module).__name__} has no submodule {path!r}; "
                             f"its lists of equal modules are {names}") from None
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"P2RStrategy(blocks={path!r}) names a {type(blocks).__name__}; it must name the "
                             "nn.ModuleList holding the blocks, run in order by a module's forward")
    if holder_path is None:
        holder_path = _holder_path(path, module)
    elif not (holder_path == "" or path.startswith(holder_path + ".")):
        raise ValueError(f"the block holder {holder_path!r} does not contain the block list {path!r}")
    holder = module.get_submodule(holder_path)
    sharing = vars(holder).get("layer_sharing")
    if sharing is not None and holder.get_submodule(sharing.path) is blocks:
        # A pseudo decoder (sharing.share_layers): its contract names the unique blocks, already declared.
        unique = holder.blocks
        return DeclaredBlocks(path, holder_path, detected=detected, size=len(unique),
                              kind=type(unique[0]).__name__ if len(unique) else "", named_by=named_by)
    current = getattr(holder, "blocks", None)
    if current is not None and current is not blocks and "blocks" not in vars(holder):
        raise ValueError(f"P2RStrategy(blocks={path!r}): {type(holder).__name__} already has an attribute 'blocks' "
                         "that is not this list")
    if current is not blocks:
        vars(holder)["blocks"] = blocks  # an alias only: the list stays registered once, under its own name
    if not isinstance(getattr(holder, "layer_to_block", None), list):
        vars(holder)["layer_to_block"] = list(range(len(blocks)))
    return DeclaredBlocks(path, holder_path, detected=detected, size=len(blocks),
                          kind=type(blocks[0]).__name__ if len(blocks) else "", named_by=named_by)


class BlockCallCheck:
    """Records, during one forward, whether the holder's ``forward`` ran and which blocks ran in which order, and
    refuses a declaration the model's forward does not follow (before the optimizer's first step)."""

    def __init__(self, holder: nn.Module) -> None:
        self.holder = holder
        self.holder_ran = False
        self.calls: list[int] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        handles = [self.holder.register_forward_pre_hook(lambda *_: setattr(self, "holder_ran", True))]
        for index, block in enumerate(self.holder.blocks):
            handles.append(block.register_forward_pre_hook(lambda *_, i=index: self.calls.append(i)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def check(self) -> None:
        name = type(self.holder).__name__
        if not self.calls:
            return  # this step ran no block through the model's forward (a step runner calls them itself)
        if not self.holder_ran:
            raise ValueError(f"P2RStrategy: the blocks are declared on {name}, whose forward never ran in the first "
                             "training step; declare them on the module whose forward calls them (blocks=...)")
        expected = list(self.holder.layer_to_block)
        if self.calls != expected:
            raise ValueError(f"P2RStrategy: {name}'s forward called its blocks in the order {self.calls}, not "
                             f"{expected} (layer_to_block): the strategy streams and shards blocks in that order; "
                             "pass blocks='<dotted path>' naming the list the model runs, once each, in order")
