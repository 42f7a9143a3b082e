"""ReplicatedZeroOptimizer on one gloo process (plain parameters); the DTensor and 2-rank paths run in
tests/distributed/test_sharding.py."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_p2r.strategy.replicated_zero import ReplicatedZeroOptimizer, to_module_optimizer


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, link: bool) -> None:
    model(torch.ones(2, 3)).pow(2).sum().backward()
    if link:
        optimizer.link_grads()
    optimizer.step()
    optimizer.zero_grad()


def test_steps_like_the_optimizer_it_wraps(process_group) -> None:
    reference, ours = _model(), _model()
    groups = [{"params": list(ours[0].parameters()), "weight_decay": 0.1},
              {"params": list(ours[1].parameters()), "weight_decay": 0.0}]
    plain = torch.optim.AdamW([{"params": list(reference[0].parameters()), "weight_decay": 0.1},
                               {"params": list(reference[1].parameters()), "weight_decay": 0.0}], lr=0.1)
    zero = ReplicatedZeroOptimizer.wrap(torch.optim.AdamW(groups, lr=0.1))
    for _ in range(3):
        _step(reference, plain, link=False)
        _step(ours, zero, link=True)
        assert all(p.grad is None for p in ours.parameters())  # zero_grad clears the module's gradients too
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_without_linking_the_gradients_nothing_moves(process_group) -> None:
    """The negative control: the views' gradients are what the partition steps."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    zero = ReplicatedZeroOptimizer.wrap(torch.optim.SGD(model.parameters(), lr=0.1))
    _step(model, zero, link=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_module_optimizer_round_trip_keeps_groups_and_state(process_group) -> None:
    model = _model()
    user = torch.optim.AdamW(model.parameters(), lr=0.1)
    user.param_groups[0]["initial_lr"] = 0.1  # what an LR scheduler adds
    zero = ReplicatedZeroOptimizer.wrap(user)
    _step(model, zero, link=True)
    whole = to_module_optimizer(zero, world_size=1, rank=0)
    assert whole.param_groups[0]["params"][0] is model[0].weight
    assert whole.param_groups[0]["initial_lr"] == 0.1
    exp_avg = whole.state[model[0].weight]["exp_avg"]
    again = ReplicatedZeroOptimizer.wrap(torch.optim.AdamW(model.parameters(), lr=0.5))
    again.load_whole_state(whole)
    assert again.param_groups[0]["lr"] == 0.1  # the checkpoint's settings, not the fresh optimizer's
    assert again.optim.param_groups[0]["lr"] == 0.1
    torch.testing.assert_close(to_module_optimizer(again, 1, 0).state[model[0].weight]["exp_avg"], exp_avg)


def test_plain_parameters_move_into_the_packed_buffers_and_keep_their_gradient_hooks(process_group) -> None:
    """Over plain tensors of one dtype each rank's partition is one buffer (one broadcast per rank after a step): the
    module's parameters live in it with their views, and a hook on each parameter's gradient accumulator node,
    taken before the move (what DDP's reducer holds), still fires after it."""
    model = _model()
    fired = []
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    for accumulator in accumulators:
        accumulator.register_hook(lambda *_: fired.append(1))
    zero = ReplicatedZeroOptimizer.wrap(torch.optim.AdamW(model.parameters(), lr=0.1))
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(zero.whole_params, zero.views))
    ends = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters())
    assert all(end == start for (_, end), (start, _) in zip(ends, ends[1:]))  # one contiguous buffer
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, zero, link=True)
    assert len(fired) == len(before)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_parameters_of_two_dtypes_keep_one_broadcast_each() -> None:
    from lightning_p2r.strategy.replicated_zero import can_share_buckets

    assert can_share_buckets([torch.zeros(2), torch.zeros(3)])
    assert not can_share_buckets([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)])
    assert not can_share_buckets([])


def test_unpacked_copies_views_of_a_buffer_into_their_own_storage_and_keeps_ties() -> None:
    from lightning_p2r.strategy.replicated_zero import unpacked

    buffer = torch.arange(10.0)
    own = torch.ones(3)
    first, second = buffer[:4].view(2, 2), buffer[4:]
    state = {"a": first, "a_tied": first, "b": second, "c": own, "step": 3}
    out = unpacked(state)
    assert out["c"] is own and out["step"] == 3
    for name in ("a", "b"):
        assert torch.equal(out[name], state[name])
        assert out[name].untyped_storage().nbytes() == out[name].numel() * out[name].element_size()
    assert out["a_tied"] is out["a"]
    buffer.zero_()  # copies, not views
    assert out["b"].sum() == sum(range(4, 10))
