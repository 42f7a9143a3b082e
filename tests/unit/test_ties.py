"""The tie rules (``strategy/ties.py``): which names share a parameter, which FSDP2 root holds them all, what is
refused before the first step, and a tied model checkpointed and resumed under zero3 with its tie intact."""

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_p2r import P2RStrategy
from lightning_p2r.strategy.checkpoint import read_model_state, to_single_file
from lightning_p2r.strategy.ties import (
    check_offloaded_blocks_untied,
    check_tensor_parallel_ties,
    check_ties_kept,
    check_ties_within_units,
    find_ties,
    retie,
    smallest_parameter_root,
    tie_remedy,
)

V, D = 16, 8


class Decoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.layer_to_block = list(range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layer_to_block:
            x = x + self.blocks[layer](x)
        return x


class HeadBeside(nn.Module):
    """Hugging Face's shape: the head beside the decoder, tied to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.model.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def test_ties_are_found_by_name_and_the_root_holds_every_name() -> None:
    net = HeadBeside()
    assert find_ties(net) == [("model.embed.weight", "lm_head.weight")]
    wrapper = nn.Module()
    wrapper.net = net
    # The decoder holds every *parameter* (the tied one through its embedding) but not the head's name: the root is
    # their parent, so fully_shard swaps both names.
    assert smallest_parameter_root(wrapper) is net
    untied = HeadBeside()
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    holder = nn.Module()
    holder.net = untied
    assert find_ties(untied) == []
    assert smallest_parameter_root(holder) is untied


def test_a_module_registered_twice_is_one_unit_and_not_a_cross_unit_tie() -> None:
    net = HeadBeside()
    net.model.layers = net.model.blocks  # the docs' old advice: the list under two names
    check_ties_within_units(net, list(net.model.blocks), "sharding='zero3'")


def test_a_tie_across_a_block_and_the_root_is_refused_naming_both_names() -> None:
    net = HeadBeside()
    net.model.blocks[1].weight = net.model.blocks[0].weight  # a user's tie between two blocks
    with pytest.raises(ValueError, match=r"model\.blocks\.0\.weight \(in model\.blocks\.0\).*model\.blocks\.1\.weight"):
        check_ties_within_units(net, list(net.model.blocks), "sharding='zero3'")
    check_ties_within_units(net, [], "sharding='zero3'")  # no units: the root holds both, fine


def test_a_cross_unit_tie_is_told_the_layout_change_that_keeps_it() -> None:
    """Offload across processes wraps every block in FSDP2 whatever the sharding: the refusal once told such a run
    (sharding='none', offload_fraction=0.5) to "use sharding='none'/'zero1'", which it did."""
    assert tie_remedy("zero3", offloading=False, layered=False) == "or use sharding='none'/'zero1'"
    for sharding, offloading, layered in (("none", True, False), ("zero1", False, True), ("zero3", True, False)):
        assert "without offload and layered accumulation" in tie_remedy(sharding, offloading, layered)
    net = HeadBeside()
    net.model.blocks[1].weight = net.model.blocks[0].weight
    with pytest.raises(ValueError, match=r"P2RStrategy\(offload_fraction=0\.5\) cannot keep a tie across FSDP2 units.*"
                                         r"or train without offload and layered accumulation across processes"):
        check_ties_within_units(net, list(net.model.blocks), "offload_fraction=0.5", tie_remedy("none", True, False))


class NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)


def _stack(layers: int = 3) -> nn.Module:
    stack = nn.Module()
    stack.layers = nn.ModuleList(NormedBlock() for _ in range(layers))
    vars(stack)["blocks"] = stack.layers  # the strategy's unregistered alias (strategy/blocks.py)
    stack.layer_to_block = list(range(layers))
    return stack


def test_offload_refuses_a_block_submodule_registered_outside_the_blocks_and_keeps_an_aliased_block() -> None:
    """A block's module registered again outside the blocks (``final_norm = layers[-1].norm``) would run on empty
    placeholders once the block is offloaded: it used to fail mid-forward with "its data is not allocated yet";
    now it is refused when offload is placed, naming both names and the fix. A whole block under a second name
    (``final_layer = layers[-1]``) is the block itself, and stays accepted."""
    stack = _stack()
    stack.final_norm = stack.layers[2].norm
    with pytest.raises(ValueError, match=r"module 'final_norm' is 'layers\.2\.norm' of offloaded block 2, registered "
                                         r"again outside the blocks.*keep block 2 on the device"):
        check_offloaded_blocks_untied(stack, (2,))
    check_offloaded_blocks_untied(stack, (0, 1))  # block 2 stays on the device: nothing to refuse
    stack = _stack()
    stack.head = nn.Linear(D, D)
    stack.head.weight = stack.layers[0].fc.weight  # one parameter, not a module, tied outside
    with pytest.raises(ValueError, match=r"module 'head' holds 'weight', a parameter of offloaded block 0"):
        check_offloaded_blocks_untied(stack, (0,))
    stack = _stack()
    stack.layers[1].norm = stack.layers[0].norm
    with pytest.raises(ValueError, match="blocks 0 and 1 share a parameter"):
        check_offloaded_blocks_untied(stack, (1,))
    check_offloaded_blocks_untied(stack, (2,))
    stack = _stack()
    stack.final_layer = stack.layers[2]
    check_offloaded_blocks_untied(stack, (0, 1, 2))


def test_tensor_parallel_refuses_a_tie_split_under_one_name_only() -> None:
    net = HeadBeside()
    with pytest.raises(ValueError, match=r"lm_head\.weight \(not split\)"):
        check_tensor_parallel_ties(net, {"model.embed": "vocabulary"})
    with pytest.raises(ValueError, match="registered as"):
        check_tensor_parallel_ties(net, {"model.embed": "vocabulary", "lm_head": "column"})
    check_tensor_parallel_ties(net, {"model.embed": "vocabulary", "lm_head": "output"})
    check_tensor_parallel_ties(net, {"model.blocks.0": "column"})  # the tie untouched


def test_retie_points_every_name_at_the_first_and_a_broken_tie_is_caught() -> None:
    net = HeadBeside()
    ties = find_ties(net)
    net.model.embed.weight = nn.Parameter(torch.zeros(V, D))  # what a layout step that swaps one name does
    with pytest.raises(RuntimeError, match="untied model.embed.weight, lm_head.weight"):
        check_ties_kept(net, ties)
    retie(net, ties)
    assert net.lm_head.weight is net.model.embed.weight
    check_ties_kept(net, ties)


class TiedModule(L.LightningModule):
    def __init__(self, cross_block_tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = HeadBeside()
        if cross_block_tie:
            self.net.model.blocks[1].weight = self.net.model.blocks[0].weight
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> torch.utils.data.DataLoader:
    # Two batches an epoch: a run stopped after 2 steps ends an epoch, so its resumption reads what the whole run does.
    data = (torch.randint(0, V, (8, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(9)) % V
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(tmp_path: Path, strategy: object, steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                     use_distributed_sampler=False, enable_checkpointing=False)


def test_fsdp2_refuses_a_tie_across_blocks_before_the_first_step(tmp_path: Path) -> None:
    module = TiedModule(cross_block_tie=True)
    with pytest.raises(ValueError, match="cannot keep a tie across FSDP2 units"):
        _trainer(tmp_path, P2RStrategy(sharding="zero3"), 2).fit(module, _data())
    assert module.losses == []


def _save_and_resume(tmp_path: Path, strategy: object) -> tuple[list[float], TiedModule]:
    first = TiedModule()
    trainer = _trainer(tmp_path / "first", strategy(), 2)
    trainer.fit(first, _data())
    trainer.save_checkpoint(tmp_path / "tied.ckpt")
    resumed = TiedModule()
    _trainer(tmp_path / "resumed", strategy(), 4).fit(resumed, _data(), ckpt_path=tmp_path / "tied.ckpt")
    return first.losses + resumed.losses, resumed


def test_a_tied_model_saved_sharded_resumes_tied_like_a_plain_trainer(tmp_path: Path) -> None:
    expected, _ = _save_and_resume(tmp_path / "plain", lambda: "auto")
    losses, resumed = _save_and_resume(tmp_path / "zero3", lambda: P2RStrategy(sharding="zero3"))
    assert (tmp_path / "zero3" / "tied.ckpt").is_dir()  # a sharded (DCP) checkpoint
    assert resumed.net.lm_head.weight is resumed.net.model.embed.weight
    assert losses == pytest.approx(expected, rel=1e-6)
    # Stored once (under its first name), read back under both names, as one tensor in a single-file conversion.
    stored = dcp.FileSystemReader(str(tmp_path / "zero3" / "tied.ckpt")).read_metadata().state_dict_metadata
    assert "model.net.model.embed.weight" in stored and "model.net.lm_head.weight" not in stored
    whole = read_model_state(tmp_path / "zero3" / "tied.ckpt")
    assert whole["net.lm_head.weight"] is whole["net.model.embed.weight"]
    single = to_single_file(tmp_path / "zero3" / "tied.ckpt", tmp_path / "single.ckpt")["state_dict"]
    plain = TiedModule()
    plain.load_state_dict(single)  # strict: every name present
    assert torch.equal(plain.net.lm_head.weight, whole["net.model.embed.weight"])


class BuiltInPlace(L.LightningModule):
    """A user's tied model built in ``configure_model`` (on the meta device under P2RStrategy), default inits."""

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = HeadBeside()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class BuiltInPlaceWithItsInit(BuiltInPlace):
    def init_module(self, module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            nn.init.normal_(param, std=0.02)


def test_a_users_model_initialized_by_module_defaults_in_place_is_told_so() -> None:
    """A user's own model built on the meta device loses whatever init its constructor ran (a new-user audit found a
    first loss of 19.9 instead of 4.2, with no word): the note names the module kinds reset_parameters() fills and
    the hook that would do the model's init. Not for a model whose rule covers every module, nor a library's."""
    from lightning_p2r.strategy.materialize import default_init_note

    note = default_init_note(HeadBeside())
    assert note.startswith("HeadBeside was built on the meta device: its modules (3 Linear, 1 Embedding)")
    assert "init_module(module)" in note
    assert default_init_note(HeadBeside(), hook=lambda module: None) is None
    assert default_init_note(nn.Sequential(nn.Linear(2, 2))) is None  # torch's own: its eager build has the defaults
    assert default_init_note(nn.Module()) is None
    sharded = HeadBeside()
    # fully_shard gives a module a class of its own, derived in torch.distributed: the model's class counts.
    from torch.distributed.fsdp import FSDPModule

    sharded.__class__ = type("FSDPHeadBeside", (FSDPModule, HeadBeside), {"__module__": FSDPModule.__module__})
    assert default_init_note(sharded).startswith("HeadBeside was built on the meta device")


def test_a_tie_between_modules_with_different_default_inits_is_named() -> None:
    from lightning_p2r.strategy.materialize import ambiguous_tied_inits

    note, = ambiguous_tied_inits(HeadBeside())
    assert note.startswith("the tied parameter model.embed.weight = lm_head.weight is initialized by "
                           "Embedding.reset_parameters()") and "['Embedding', 'Linear']" in note
    assert ambiguous_tied_inits(HeadBeside(), hook=lambda module: None) == []  # the model's own rule: one for both
    untied = HeadBeside()
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    assert ambiguous_tied_inits(untied) == []


def test_a_tied_model_built_in_place_with_default_inits_is_warned_about(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"P2RStrategy: the tied parameter model\.embed\.weight = lm_head\.weight is "
                                         r"initialized by Embedding\.reset_parameters\(\).*init_module\(module\)"):
        _trainer(tmp_path / "default", P2RStrategy(), 1).fit(BuiltInPlace(), _data())
    with pytest.warns(UserWarning, match=r"P2RStrategy: HeadBeside was built on the meta device: its modules \(3 "
                                         r"Linear, 1 Embedding\) take the values of their reset_parameters\(\)"):
        _trainer(tmp_path / "default_again", P2RStrategy(), 1).fit(BuiltInPlace(), _data())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path / "hook", P2RStrategy(), 1).fit(BuiltInPlaceWithItsInit(), _data())
    assert not [w for w in caught if "tied parameter" in str(w.message) or "meta device" in str(w.message)]


def test_a_block_registered_at_several_layers_is_split_once_and_is_no_tie_to_cut() -> None:
    """A pseudo model runs one block at several layers: its parameters have several names through one module, which
    tensor parallelism splits once for all of them."""
    net = HeadBeside()
    net.model.blocks[1] = net.model.blocks[0]  # layers 0 and 1 run one block
    check_tensor_parallel_ties(net, {"model.blocks.0": "column", "model.blocks.1": "column"})
    check_tensor_parallel_ties(net, {"model.blocks.0": "column"})  # named under its first layer only
    with pytest.raises(ValueError, match=r"model\.embed\.weight \(vocabulary\), lm_head\.weight \(not split\)"):
        check_tensor_parallel_ties(net, {"model.embed": "vocabulary"})  # a tie between two modules still is one


def test_a_pseudo_models_unique_blocks_are_named_by_the_layers_running_them() -> None:
    from lightning_p2r.strategy.blocks import block_list_name, block_names

    net = HeadBeside()
    assert block_names(net.model) == ["blocks.0", "blocks.1"] and block_list_name(net.model) == "blocks"
    layers = nn.ModuleList([Decoder().blocks[0] for _ in range(2)])
    holder = nn.Module()
    holder.layers = nn.ModuleList([layers[0], layers[0], layers[1], layers[1]])  # 4 layers, 2 unique blocks
    vars(holder)["blocks"] = layers  # the strategy's alias, not registered
    assert block_names(holder) == ["layers.0", "layers.2"] and block_list_name(holder) == "layers"
    # A pipeline rank holding block 1 only: block 0 is a stand-in the model does not hold, named by its first layer
    holder.layers = nn.ModuleList([nn.Identity(), nn.Identity(), layers[1], layers[1]])
    vars(holder)["blocks"] = nn.ModuleList([nn.Module(), layers[1]])
    vars(holder)["layer_to_block"] = [0, 0, 1, 1]
    assert block_names(holder) == ["layers.0", "layers.2"]


def _plan_of(model: nn.Module):
    from lightning_p2r.protocols import ParallelPlan

    return ParallelPlan(tuple({} for _ in model.blocks), {})


def test_a_plan_declared_from_outside_follows_a_deep_copy_of_its_model() -> None:
    import copy

    from lightning_p2r.protocols import DeclaredPlan

    net = Decoder(layers=2)
    DeclaredPlan.attach(net, _plan_of)
    copied = copy.deepcopy(net)
    copied.blocks.append(nn.Linear(D, D))
    assert len(net.parallel_plan().blocks) == 2 and len(copied.parallel_plan().blocks) == 3
    import pickle

    unpickled = pickle.loads(pickle.dumps(copied))
    assert len(unpickled.parallel_plan().blocks) == 3 and unpickled.parallel_plan._model() is unpickled
