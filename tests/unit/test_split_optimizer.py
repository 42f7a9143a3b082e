"""The split optimizer on its own (no Trainer): one AdamW to the outside, a device part and host parts inside.

Comparisons are bit for bit against a plain AdamW over an un-offloaded copy of the model, both built with
``fused=True``: the host side always uses torch's fused CPU kernel, so on one process both then run the same kernel
on the same numbers. (With the default ``fused=None`` the plain AdamW runs the single-tensor kernel, whose results
differ from the fused one's in the last bits: that case is compared to a tight tolerance.)
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import run_layered
from torch import nn

from lightning_p2r.protocols import LayeredStages
from lightning_p2r.strategy.offload import BlockStreamer, StreamerEvents
from lightning_p2r.strategy.split_optimizer import (
    SplitOptimizer,
    detach_to_host,
    device_optimizer_state_bytes,
    host_step_overlap_allowed,
    optimizer_state_bytes,
    release_to_host,
    split_single_optimizer,
)

CPU = torch.device("cpu")
DIM = 8


class Block(nn.Module):
    """A residual block with a ``gate`` that takes part only while ``gated`` (so it can miss a step's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(2 * DIM, DIM, bias=False)
        self.gate = nn.Parameter(torch.full((DIM,), 0.5))
        self.gated = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.out(torch.tanh(self.fc(self.norm(x))))
        return x + (update * self.gate if self.gated else update)


class Net(nn.Module):
    def __init__(self, layer_to_block: tuple[int, ...] = (0, 1, 2, 3)) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(max(layer_to_block) + 1))
        self.layer_to_block = list(layer_to_block)
        self.head = nn.Linear(DIM, 1)

    def set_gated(self, gated: bool) -> None:
        for block in self.blocks:
            block.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index in self.layer_to_block:
            x = self.blocks[index](x)
        return self.head(x).square().mean()

    def stages(self) -> LayeredStages:
        return LayeredStages(embed=lambda batch: (self.embed(batch), None),
                             layer=lambda layer, x, context: (self.blocks[self.layer_to_block[layer]](x), None),
                             head=lambda x, context: (self.head(x).square().mean(), {}),
                             layer_to_block=self.layer_to_block)


def adamw(model: nn.Module, **kwargs: object) -> torch.optim.AdamW:
    """Two groups that interleave offloaded and resident parameters: decayed matrices, undecayed vectors."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=2e-2,
                             weight_decay=0.1, **({"fused": True} | kwargs))


def build(offloaded: tuple[int, ...] = (1, 3), *, offload_params: bool = True, layer_to_block=(0, 1, 2, 3),
          **kwargs: object) -> tuple[Net, torch.optim.AdamW, Net, BlockStreamer, SplitOptimizer]:
    """(reference model, its plain AdamW, the model under an engine, the engine, the split optimizer)."""
    torch.manual_seed(0)
    reference = Net(layer_to_block)
    model = copy.deepcopy(reference)
    engine = BlockStreamer(model, offloaded, CPU, prefetch=1, param_prefix="blocks.", offload_params=offload_params)
    split = split_single_optimizer([adamw(model, **kwargs)], engine)
    return reference, adamw(reference, **kwargs), model, engine, split


def batch(seed: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(seed))


def train_step(model: Net, optimizer: torch.optim.Optimizer, seed: int, engine: BlockStreamer | None = None) -> None:
    optimizer.zero_grad()
    model(batch(seed)).backward()
    if engine is not None:
        engine.finish_backward()  # what the strategy's post_backward does
    optimizer.step()


def weights(model: nn.Module, engine: BlockStreamer | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's value by name: the host master for an offloaded one."""
    values = {name: p.detach() for name, p in model.named_parameters()}
    if engine is not None:
        values |= {name: t.detach() for name, t in engine.host_tensors().items()}
    return values


def assert_same(ours: dict, reference: dict, exact: bool = True) -> None:
    assert ours.keys() == reference.keys()
    for name, want in reference.items():
        if exact:
            assert torch.equal(ours[name], want), f"{name} differs by {(ours[name] - want).abs().max().item()}"
        else:  # another AdamW kernel: last-bit differences only
            torch.testing.assert_close(ours[name], want, rtol=1e-6, atol=1e-7, msg=name)


def assert_same_optimizer_state(ours: dict, reference: dict) -> None:
    assert ours["param_groups"] == reference["param_groups"]
    assert ours["state"].keys() == reference["state"].keys()
    for slot, want in reference["state"].items():
        assert ours["state"][slot].keys() == want.keys(), slot
        for key, value in want.items():
            assert torch.equal(ours["state"][slot][key], value), (slot, key)


def host_step_threads() -> set[threading.Thread]:
    """The live threads of split optimizers' host-step executors (compare sets: earlier tests may leave theirs)."""
    return {t for t in threading.enumerate() if t.name.startswith("p2r-host-step")}


# ----------------------------------------------------------------------------------------------- stepping
@pytest.mark.parametrize(("offloaded", "offload_params", "kwargs"), [
    ((1, 3), True, {}),
    ((0, 1, 2, 3), True, {}),
    ((1, 3), False, {}),
    ((0, 2), True, {"fused": None}),
    ((0, 2), True, {"fused": None, "foreach": True}),
])
def test_steps_match_a_plain_adamw(offloaded: tuple[int, ...], offload_params: bool, kwargs: dict) -> None:
    reference, plain, model, engine, split = build(offloaded, offload_params=offload_params, **kwargs)
    assert set(split.host_optimizers) == set(offloaded)
    masters = engine.host_tensors()
    names = {id(p): name for name, p in model.named_parameters()}
    # canonical groups: the plain optimizer's slots, each offloaded parameter replaced by its host master
    for group, plain_group in zip(split.param_groups, adamw(model).param_groups):
        expected = [masters.get(names[id(p)], p) for p in plain_group["params"]]
        assert [id(p) for p in group["params"]] == [id(p) for p in expected]
    device_params = {id(p) for g in split.device_optimizer.param_groups for p in g["params"]}
    assert device_params == {id(p) for n, p in model.named_parameters() if n not in masters}
    for optimizer in split.host_optimizers.values():
        assert all(g["fused"] is True for g in optimizer.param_groups)  # the fast CPU kernel on the host

    for seed in (1, 2, 3):
        train_step(reference, plain, seed)
        train_step(model, split, seed, engine)
        assert_same(weights(model, engine), weights(reference), exact=kwargs.get("fused", True) is True)
    for name, master in masters.items():
        param = model.get_parameter(name)
        if offload_params:
            assert param.untyped_storage().size() == 0  # the step ran on the host master only
        else:
            assert torch.equal(param, master)  # the resident copy was refreshed after the host step


def test_step_with_a_closure_returns_its_loss() -> None:
    reference, plain, model, engine, split = build()

    def closure_of(net: Net, optimizer: torch.optim.Optimizer, with_engine: bool):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = net(batch(1))
            loss.backward()
            if with_engine:
                engine.finish_backward()
            return loss
        return closure

    want = plain.step(closure_of(reference, plain, False))
    got = split.step(closure_of(model, split, True))
    assert torch.equal(got, want)
    assert_same(weights(model, engine), weights(reference))


def test_a_parameter_without_a_gradient_this_step_is_skipped_as_plain_adamw_skips_it() -> None:
    reference, plain, model, engine, split = build((0, 1, 2, 3))
    train_step(reference, plain, 1)
    train_step(model, split, 1, engine)
    reference.set_gated(False)
    model.set_gated(False)  # the gates get no gradient now: AdamW must not decay them or move their moments
    for seed in (2, 3):
        train_step(reference, plain, seed)
        train_step(model, split, seed, engine)
    assert_same(weights(model, engine), weights(reference))
    assert_same_optimizer_state(split.state_dict(), plain.state_dict())


def test_submitted_host_steps_give_the_same_result_as_a_plain_step() -> None:
    """overlap_host_step: each block's host step starts as soon as backward offloaded its gradient."""
    reference, plain, model, engine, split = build((0, 1, 2, 3))
    submitted: list[int] = []

    def submit(index: int) -> None:
        submitted.append(index)
        split.submit_host_step(index)

    engine.on_block_grads_ready = submit
    threads_before = host_step_threads()
    for seed in (1, 2, 3):
        train_step(reference, plain, seed)
        train_step(model, split, seed, engine)
        assert_same(weights(model, engine), weights(reference))
    assert submitted == [3, 2, 1, 0] * 3
    ours = host_step_threads() - threads_before
    assert len(ours) == 1  # one worker: blocks step one after another, in submission order
    assert engine.take_stats().host_step_seconds > 0
    split.shutdown()
    assert not any(t.is_alive() for t in ours)


# ------------------------------------------------------------------------------------------- hyperparameters
def test_hyperparameter_changes_reach_the_device_and_host_parts() -> None:
    reference, plain, model, engine, split = build()
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step) for o in (plain, split)]
    for optimizer in (plain, split):
        optimizer.param_groups[1]["weight_decay"] = 0.05
        optimizer.param_groups[1]["betas"] = (0.8, 0.99)
    for seed in (1, 2, 3):
        train_step(reference, plain, seed)
        train_step(model, split, seed, engine)
        for scheduler in schedulers:
            scheduler.step()
        assert_same(weights(model, engine), weights(reference))
    inner = [split.device_optimizer, *split.host_optimizers.values()]
    for optimizer in inner:
        for group in optimizer.param_groups:
            canonical = split.param_groups[group["_canonical"]]
            assert group["lr"] == 2e-2 * 0.5 ** 2  # copied from the canonical group before the last step
            assert canonical["lr"] == 2e-2 * 0.5 ** 3  # where the scheduler has moved it since
            assert group["betas"] == canonical["betas"] == ((0.8, 0.99) if group["_canonical"] else (0.9, 0.999))


def test_zero_grad_clears_both_parts() -> None:
    reference, plain, model, engine, split = build()
    train_step(reference, plain, 1)
    train_step(model, split, 1, engine)
    model(batch(2)).backward()
    split.zero_grad()
    assert all(p.grad is None for g in split.device_optimizer.param_groups for p in g["params"])
    for index, block in engine.blocks.items():
        assert not any(engine.received_gradient(index, position) for position in range(len(block.params)))
    before = {name: t.clone() for name, t in weights(model, engine).items()}
    split.step()  # nothing has a gradient of this step: nothing moves, no step is counted
    assert_same(weights(model, engine), before)
    plain.zero_grad()
    plain.step()
    assert_same_optimizer_state(split.state_dict(), plain.state_dict())
    # the next backward overwrites the host buffers instead of adding to the stale ones
    train_step(reference, plain, 3)
    train_step(model, split, 3, engine)
    assert_same(weights(model, engine), weights(reference))


# ---------------------------------------------------------------------------------------------- state dicts
def test_state_dict_is_the_plain_optimizers() -> None:
    reference, plain, model, engine, split = build()
    assert_same_optimizer_state(split.state_dict(), plain.state_dict())  # empty before the first step
    for seed in (1, 2):
        train_step(reference, plain, seed)
        train_step(model, split, seed, engine)
    state = split.state_dict()
    assert_same_optimizer_state(state, plain.state_dict())
    assert list(state["state"]) == list(plain.state_dict()["state"])  # same slot order
    assert len(split.state) == sum(1 for _ in model.parameters())
    assert device_optimizer_state_bytes(split) == sum(
        2 * p.numel() * p.element_size() for n, p in model.named_parameters() if n not in engine.host_tensors())


def test_checkpoints_move_between_plans_and_plain_optimizers() -> None:
    reference, plain, model, engine, split = build((1, 3))
    train_step(reference, plain, 1)
    train_step(model, split, 1, engine)
    saved_weights = {name: t.clone() for name, t in weights(model, engine).items()}
    saved_state = copy.deepcopy(split.state_dict())

    def restored(offloaded: tuple[int, ...] | None) -> tuple[Net, torch.optim.Optimizer, BlockStreamer | None]:
        net = Net()
        net.load_state_dict(saved_weights)
        if offloaded is None:
            optimizer = adamw(net)
            optimizer.load_state_dict(copy.deepcopy(saved_state))
            return net, optimizer, None
        net_engine = BlockStreamer(net, offloaded, CPU, param_prefix="blocks.")
        optimizer = split_single_optimizer([adamw(net)], net_engine)
        optimizer.load_state_dict(copy.deepcopy(saved_state))
        return net, optimizer, net_engine

    runs = [(model, split, engine), restored((0, 2)), restored((0, 1, 2, 3)), restored(None)]
    # the carry path (after delinking): an ordinary optimizer's state handed to a new split optimizer
    carried = Net()
    carried.load_state_dict(saved_weights)
    carried_engine = BlockStreamer(carried, (2,), CPU, param_prefix="blocks.")
    # (a copy: like torch's load_state_dict, carrying shares the state tensors, and the reference steps on)
    carried_split = split_single_optimizer([adamw(carried)], carried_engine, carry_state_from=copy.deepcopy(plain))
    runs.append((carried, carried_split, carried_engine))
    train_step(reference, plain, 2)
    for net, optimizer, net_engine in runs:
        train_step(net, optimizer, 2, net_engine)
        assert_same(weights(net, net_engine), weights(reference))
        assert_same_optimizer_state(optimizer.state_dict(), plain.state_dict())


def test_load_state_dict_refuses_other_groups_and_new_groups_are_refused() -> None:
    _, plain, _, engine, split = build()
    state = plain.state_dict()
    state["param_groups"][1]["params"] = state["param_groups"][1]["params"][:-1]
    with pytest.raises(ValueError, match="parameter groups"):
        split.load_state_dict(state)
    with pytest.raises(NotImplementedError, match="new parameter groups"):
        split.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="one optimizer"):
        split_single_optimizer([plain, plain], engine)


# ---------------------------------------------------------------------------------------------- teardown
def test_detach_to_host_returns_a_plain_optimizer_over_the_modules_parameters() -> None:
    reference, plain, model, engine, split = build((0, 2))
    for seed in (1, 2):
        train_step(reference, plain, seed)
        train_step(model, split, seed, engine)
    state = copy.deepcopy(split.state_dict())
    detached = detach_to_host(engine, split, model)
    assert type(detached) is torch.optim.AdamW
    assert engine.blocks == {}
    # the same slots as an AdamW built over the module now: the module's own parameters, in the same order
    assert [[id(p) for p in g["params"]] for g in detached.param_groups] == \
        [[id(p) for p in g["params"]] for g in adamw(model).param_groups]
    assert all(p.untyped_storage().size() > 0 and p.device == CPU for p in model.parameters())
    assert_same(weights(model), weights(reference))
    assert_same_optimizer_state(detached.state_dict(), state)
    train_step(reference, plain, 3)
    train_step(model, detached, 3)  # no engine any more: an ordinary model and optimizer
    assert_same(weights(model), weights(reference))
    # an optimizer that was never split comes back as it is
    assert detach_to_host(None, plain, reference) is plain


def test_release_to_host_stops_host_steps_and_gives_parameters_back() -> None:
    reference, plain, model, engine, split = build((1, 2, 3))
    engine.on_block_grads_ready = split.submit_host_step
    threads_before = host_step_threads()
    train_step(reference, plain, 1)
    train_step(model, split, 1, engine)
    ours = host_step_threads() - threads_before
    assert ours
    release_to_host([split, plain], engine)
    assert not any(t.is_alive() for t in ours)
    assert engine.blocks == {}
    assert all(p.untyped_storage().size() > 0 and p.device == CPU for p in model.parameters())
    assert_same(weights(model), weights(reference))
    release_to_host([plain], None)  # nothing to release: no error


def test_optimizer_state_bytes_count_the_device_side_only() -> None:
    reference, plain, model, engine, split = build((0, 1, 2, 3))
    assert device_optimizer_state_bytes(None) == 0 and device_optimizer_state_bytes(split) == 0
    train_step(reference, plain, 1)
    train_step(model, split, 1, engine)
    everything = sum(2 * p.numel() * p.element_size() for p in reference.parameters())
    outside_blocks = sum(2 * p.numel() * p.element_size() for n, p in reference.named_parameters()
                         if not n.startswith("blocks."))
    assert optimizer_state_bytes(plain) == device_optimizer_state_bytes(plain) == everything
    assert device_optimizer_state_bytes(split) == outside_blocks
    assert optimizer_state_bytes(split) == everything  # the merged state of both parts


class _Module(L.LightningModule):
    pass


class _Clipping(L.LightningModule):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pass


class _Stepping(L.LightningModule):
    def optimizer_step(self, *args, **kwargs):
        pass


@pytest.mark.parametrize(("overlap", "device", "module_class", "trainer", "scaler", "manual", "allowed"), [
    ("auto", "cpu", _Module, {}, None, False, False),  # on a CPU the host step would compete with backward
    ("auto", "cuda", _Module, {}, None, False, True),
    (True, "cpu", _Module, {}, None, False, True),
    (False, "cuda", _Module, {}, None, False, False),
    (True, "cpu", _Module, {"gradient_clip_val": 1.0}, None, False, False),
    (True, "cpu", _Module, {"accumulate_grad_batches": 2}, None, False, False),
    (True, "cpu", _Module, {}, object(), False, False),
    (True, "cpu", _Module, {}, None, True, False),
    (True, "cpu", _Clipping, {}, None, False, False),
    (True, "cpu", _Stepping, {}, None, False, False),
])
def test_host_step_overlap_is_allowed_only_where_nothing_runs_between_backward_and_step(
        overlap, device, module_class, trainer, scaler, manual, allowed) -> None:
    module = module_class()
    module.trainer = SimpleNamespace(**({"gradient_clip_val": None, "accumulate_grad_batches": 1} | trainer))
    module.automatic_optimization = not manual
    precision = SimpleNamespace(scaler=scaler)
    assert host_step_overlap_allowed(overlap, torch.device(device), module, precision) is allowed


# ---------------------------------------------------- regressions (stale host gradients, shared blocks' host step)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_canonical_gradients_after_zero_grad_are_a_plain_optimizers(set_to_none: bool) -> None:
    reference, plain, model, engine, split = build((0, 1, 2, 3))
    train_step(reference, plain, 1)
    train_step(model, split, 1, engine)
    reference.set_gated(False)
    model.set_gated(False)  # this step the gates get no gradient
    for net, optimizer, net_engine in ((reference, plain, None), (model, split, engine)):
        optimizer.zero_grad(set_to_none=set_to_none)
        net(batch(2)).backward()
        if net_engine is not None:
            net_engine.finish_backward()
    # what Lightning's gradient clipping reads: the .grad of every parameter in the optimizer's groups
    canonical = [p for g in split.param_groups for p in g["params"]]
    ordinary = [p for g in plain.param_groups for p in g["params"]]
    want = torch.nn.utils.get_total_norm([p.grad for p in ordinary if p.grad is not None])
    got = torch.nn.utils.get_total_norm([p.grad for p in canonical if p.grad is not None])
    assert torch.equal(got, want)
    split.step()
    plain.step()
    assert_same(weights(model, engine), weights(reference))


def test_submitted_host_steps_with_layered_accumulation_and_shared_blocks_match_a_plain_step() -> None:
    reference, plain, model, engine, split = build((0, 1), layer_to_block=(0, 0, 1, 1))
    engine.on_block_grads_ready = split.submit_host_step  # what P2RStrategy does when overlap is allowed
    micro = list(torch.cat([batch(1), batch(2)]).split(4))
    plain.zero_grad()
    run_layered(reference.stages(), micro)
    plain.step()
    split.zero_grad()
    with StreamerEvents(engine) as events:
        run_layered(model.stages(), micro, events)
    engine.finish_backward()
    split.step()
    split.shutdown()
    assert_same_optimizer_state(split.state_dict(), plain.state_dict())
    assert_same(weights(model, engine), weights(reference))
