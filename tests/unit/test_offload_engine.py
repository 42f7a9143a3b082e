"""The block streamer and the split optimizer on their own, without the Trainer.

On a CPU-only machine the "device" is the CPU too; residency, byte counts and values are still what the engine
promises, and every comparison with the same model without the engine is bit-exact (same kernels, same order).
"""

import copy

import pytest
import torch
from equivalence import assert_bit_identical
from helpers import TINY

from lightning_p2r.models import M6Config, M6Transformer
from lightning_p2r.strategy.offload import BlockStreamer, StreamerEvents
from lightning_p2r.strategy.split_optimizer import SplitOptimizer, detach_to_host, split_single_optimizer

CPU = torch.device("cpu")
CONFIG = TINY | {"num_layers": 4, "moe_layers": [], "init_seed": 5}


def _model(**changes) -> M6Transformer:
    return M6Transformer(M6Config(**(CONFIG | changes)))


def _loss(model: M6Transformer, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    return model(tokens).logits.float().square().mean()


def _block_bytes(model: M6Transformer, index: int) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[index].parameters())


def test_construction_moves_offloaded_blocks_to_host_masters() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = BlockStreamer(model, (1, 3), CPU, param_prefix="blocks.")
    for index in (1, 3):
        for param in model.blocks[index].parameters():
            assert param.untyped_storage().size() == 0  # an empty placeholder between uses
    for param in model.blocks[0].parameters():
        assert param.untyped_storage().size() > 0
    masters = engine.host_tensors()
    assert sorted(masters) == sorted(k for k in before if k.startswith(("blocks.1.", "blocks.3.")))
    for name, master in masters.items():
        assert torch.equal(master, before[name])
    assert_bit_identical(model.state_dict(), before)  # the module's own state dict reads the masters


@pytest.mark.parametrize("prefetch", [0, 1])
def test_forward_backward_equals_plain_and_counts_bytes(prefetch: int) -> None:
    plain, model = _model(), _model()
    engine = BlockStreamer(model, (1, 3), CPU, prefetch=prefetch, param_prefix="blocks.")
    expected, loss = _loss(plain), _loss(model)
    assert torch.equal(expected, loss)
    expected.backward()
    loss.backward()
    engine.finish_backward()
    for block in engine.blocks.values():
        assert not block.resident
        for name, buffer in zip(block.names, block.host_grads):
            assert torch.equal(buffer, plain.get_parameter(name).grad), name
    for name, param in model.named_parameters():
        if not name.startswith(("blocks.1.", "blocks.3.")):
            assert torch.equal(param.grad, plain.get_parameter(name).grad), name
    stats = engine.take_stats()
    offloaded_bytes = _block_bytes(plain, 1) + _block_bytes(plain, 3)
    assert stats.fetches == 4  # each offloaded block: once in forward, once in backward
    assert stats.h2d_bytes == 2 * offloaded_bytes
    assert stats.d2h_bytes == offloaded_bytes
    assert stats.peak_resident_offloaded_blocks <= prefetch + 1


def test_accumulation_adds_host_gradients_and_a_new_step_overwrites() -> None:
    plain, model = _model(), _model()
    engine = BlockStreamer(model, (2,), CPU, param_prefix="blocks.")
    for seed in (0, 1):
        _loss(plain, seed).backward()
        _loss(model, seed).backward()
        engine.finish_backward()
    block = engine.blocks[2]
    for name, buffer in zip(block.names, block.host_grads):
        assert torch.equal(buffer, plain.get_parameter(name).grad), name
    engine.start_accumulation()  # the next optimizer step: its first gradient overwrites, not adds
    plain.zero_grad()
    _loss(plain, 2).backward()
    _loss(model, 2).backward()
    engine.finish_backward()
    for name, buffer in zip(block.names, block.host_grads):
        assert torch.equal(buffer, plain.get_parameter(name).grad), name


def test_shared_block_collects_every_layer_before_offload() -> None:
    plain, model = _model(num_unique_blocks=2), _model(num_unique_blocks=2)
    engine = BlockStreamer(model, (1,), CPU, param_prefix="blocks.")
    _loss(plain).backward()
    _loss(model).backward()
    engine.finish_backward()
    block = engine.blocks[1]
    for name, buffer in zip(block.names, block.host_grads):
        assert torch.equal(buffer, plain.get_parameter(name).grad), name


def test_keeping_parameters_resident_still_offloads_gradients() -> None:
    plain, model = _model(), _model()
    engine = BlockStreamer(model, (1,), CPU, param_prefix="blocks.", offload_params=False)
    assert all(p.untyped_storage().size() > 0 for p in model.blocks[1].parameters())
    _loss(plain).backward()
    _loss(model).backward()
    engine.finish_backward()
    block = engine.blocks[1]
    for name, buffer, param in zip(block.names, block.host_grads, block.params):
        assert torch.equal(buffer, plain.get_parameter(name).grad) and param.grad is None
    assert engine.take_stats().h2d_bytes == 0


def test_detach_gives_parameters_back_and_removes_hooks() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    engine = BlockStreamer(model, (0, 2), CPU, param_prefix="blocks.")
    engine.detach(CPU)
    assert_bit_identical(model.state_dict(), reference.state_dict())
    _loss(model).backward()
    assert engine.take_stats().fetches == 0


def test_load_state_dict_writes_the_host_masters() -> None:
    model, other = _model(), _model(init_seed=9)
    engine = BlockStreamer(model, (1,), CPU, param_prefix="blocks.")
    model.load_state_dict(other.state_dict())
    assert_bit_identical(model.state_dict(), other.state_dict())
    assert torch.equal(engine.host_tensors()["blocks.1.attn.qkv.weight"], other.blocks[1].attn.qkv.weight)
    assert all(p.untyped_storage().size() == 0 for p in model.blocks[1].parameters())  # released again


def test_engine_events_fetch_once_per_direction() -> None:
    model = _model()
    engine = BlockStreamer(model, (1,), CPU, param_prefix="blocks.")
    with StreamerEvents(engine) as events:
        events.before_forward(1)
        assert engine.blocks[1].resident
        events.after_forward(1)
        assert not engine.blocks[1].resident
        events.before_backward(1)
        assert engine.blocks[1].resident and engine.blocks[1].in_backward
        events.after_backward(1)
    assert not engine.blocks[1].resident and engine.take_stats().fetches == 2


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # Fused, as the split optimizer's host part and M6LanguageModel use: the same kernel on both sides.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _split_step(model: M6Transformer, engine: BlockStreamer, split: SplitOptimizer, seed: int) -> None:
    split.zero_grad()
    _loss(model, seed).backward()
    engine.finish_backward()
    split.step()


def test_split_optimizer_steps_like_plain_adamw_and_saves_canonically() -> None:
    plain, model = _model(), _model()
    plain_optimizer = _adamw(plain)
    engine = BlockStreamer(model, (1, 3), CPU, param_prefix="blocks.")
    split = split_single_optimizer([_adamw(model)], engine)
    for seed in range(3):
        plain_optimizer.zero_grad()
        _loss(plain, seed).backward()
        plain_optimizer.step()
        _split_step(model, engine, split, seed)
    assert_bit_identical(model.state_dict(), plain.state_dict())
    ours, theirs = split.state_dict(), plain_optimizer.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for slot in theirs["state"]:
        assert_bit_identical(ours["state"][slot], theirs["state"][slot], name=f"slot {slot}")
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]


def test_split_optimizer_loads_a_plain_state_and_shares_hyperparameters() -> None:
    plain, model = _model(), _model()
    plain_optimizer = _adamw(plain)
    _loss(plain).backward()
    plain_optimizer.step()
    model.load_state_dict(plain.state_dict())
    engine = BlockStreamer(model, (2,), CPU, param_prefix="blocks.")
    split = split_single_optimizer([_adamw(model)], engine)
    # A copy, as from a checkpoint file: torch's load_state_dict keeps the given tensors (AdamW's step counters
    # would otherwise be shared with the live optimizer and counted twice).
    split.load_state_dict(copy.deepcopy(plain_optimizer.state_dict()))
    for group in (split.param_groups[0], plain_optimizer.param_groups[0]):
        group["lr"] = 3e-3  # a scheduler's change reaches the device and the host parts alike
    plain_optimizer.zero_grad()
    _loss(plain, 1).backward()
    plain_optimizer.step()
    _split_step(model, engine, split, 1)
    assert_bit_identical(model.state_dict(), plain.state_dict())


def test_overlapped_host_step_equals_the_normal_step() -> None:
    a, b = _model(), _model()
    engine_a = BlockStreamer(a, (1, 3), CPU, param_prefix="blocks.")
    engine_b = BlockStreamer(b, (1, 3), CPU, param_prefix="blocks.")
    split_a, split_b = split_single_optimizer([_adamw(a)], engine_a), split_single_optimizer([_adamw(b)], engine_b)
    engine_b.on_block_grads_ready = split_b.submit_host_step  # step each block as soon as its gradients land
    for seed in range(2):
        _split_step(a, engine_a, split_a, seed)
        _split_step(b, engine_b, split_b, seed)
    split_b.shutdown()
    assert_bit_identical(b.state_dict(), a.state_dict())


def test_detach_to_host_returns_a_plain_optimizer_with_the_whole_state() -> None:
    plain, model = _model(), _model()
    plain_optimizer = _adamw(plain)
    engine = BlockStreamer(model, (0, 3), CPU, param_prefix="blocks.")
    split = split_single_optimizer([_adamw(model)], engine)
    plain_optimizer.zero_grad()
    _loss(plain).backward()
    plain_optimizer.step()
    _split_step(model, engine, split, 0)
    restored = detach_to_host(engine, split, model)
    assert type(restored) is torch.optim.AdamW
    assert_bit_identical(model.state_dict(), plain.state_dict())
    ours, theirs = restored.state_dict(), plain_optimizer.state_dict()
    for slot in theirs["state"]:
        assert_bit_identical(ours["state"][slot], theirs["state"][slot], name=f"slot {slot}")
