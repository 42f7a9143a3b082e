import pytest
import torch
from torch import nn

from lightning_p2r import M6Config, M6Transformer, delink
from lightning_p2r.module import parameter_groups
from lightning_p2r.sharing import rebind_scheduler


def _model(blocks: int = 1, layers: int = 4, **changes) -> M6Transformer:
    base = {"vocab_size": 64, "max_seq_len": 16, "num_layers": layers, "num_unique_blocks": blocks, "dim": 32,
            "num_heads": 4, "num_experts": 4, "attention": "alternating", "sparse_window": 4}
    return M6Transformer(M6Config(**(base | changes)))


def _trained(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for _ in range(steps):
        out = model(torch.randint(0, 64, (2, 16)))
        (out.logits.square().mean() + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()


def _block_numel(model: M6Transformer) -> int:
    return sum(p.numel() for p in model.blocks.parameters())


@pytest.mark.parametrize("blocks", [1, 2])
def test_delink_preserves_the_function(blocks: int) -> None:
    model = _model(blocks).eval()
    tokens = torch.randint(0, 64, (3, 16))
    before = model(tokens)
    delink(model)
    after = model(tokens)
    torch.testing.assert_close(after.logits, before.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(after.aux_loss, before.aux_loss, atol=1e-6, rtol=0)


def test_full_and_staged_parameter_counts() -> None:
    model = _model(1, layers=8)
    pseudo = _block_numel(model)
    delink(model, num_unique_blocks=2)
    assert len(model.blocks) == 2 and model.layer_to_block == [0, 0, 0, 0, 1, 1, 1, 1]
    assert _block_numel(model) == 2 * pseudo
    delink(model, num_unique_blocks=4)
    assert _block_numel(model) == 4 * pseudo and model.config.num_unique_blocks == 4
    delink(model)
    assert _block_numel(model) == 8 * pseudo and model.layer_to_block == list(range(8))
    # copies are independent tensors
    ids = {id(block.attn.qkv.weight) for block in model.blocks}
    assert len(ids) == 8


@pytest.mark.parametrize("policy", ["scale", "copy", "reset"])
def test_adamw_state_carried_as_the_policy_says(policy: str) -> None:
    model = _model(1)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    _trained(model, optimizer)
    shared = model.blocks[0].attn.qkv.weight
    old_state = {k: v.clone() for k, v in optimizer.state[shared].items()}
    embed_state = {k: v.clone() for k, v in optimizer.state[model.tok_embeddings.weight].items()}
    new = delink(model, optimizer, optimizer_state=policy)
    assert type(new) is torch.optim.AdamW
    assert [g["lr"] for g in new.param_groups] == [g["lr"] for g in optimizer.param_groups]
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    assert new.param_groups[0]["betas"] == (0.8, 0.9)
    for block in model.blocks:
        state = new.state.get(block.attn.qkv.weight, {})
        if policy == "reset":
            assert state == {}
            continue
        divisor = 4 if policy == "scale" else 1
        torch.testing.assert_close(state["exp_avg"], old_state["exp_avg"] / divisor)
        torch.testing.assert_close(state["exp_avg_sq"], old_state["exp_avg_sq"] / divisor**2)
        assert float(state["step"]) == float(old_state["step"])
    # parameters that were never shared keep their state untouched
    torch.testing.assert_close(new.state[model.tok_embeddings.weight]["exp_avg"], embed_state["exp_avg"])


def test_new_optimizer_orders_parameters_like_a_fresh_one() -> None:
    model = _model(1)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3)
    new = delink(model, optimizer)
    fresh = parameter_groups(model, 0.1)
    for group, fresh_group in zip(new.param_groups, fresh):
        assert [id(p) for p in group["params"]] == [id(p) for p in fresh_group["params"]]


def test_sgd_momentum_is_scaled() -> None:
    model = _model(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _trained(model, optimizer)
    buffer = optimizer.state[model.blocks[1].ffn.router.weight]["momentum_buffer"].clone()
    new = delink(model, optimizer)
    assert new.param_groups[0]["momentum"] == 0.9
    torch.testing.assert_close(new.state[model.blocks[3].ffn.router.weight]["momentum_buffer"], buffer / 2)


def test_training_continues_after_delink() -> None:
    model = _model(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _trained(model, optimizer)
    optimizer = delink(model, optimizer)
    _trained(model, optimizer)
    assert not torch.equal(model.blocks[0].attn.qkv.weight, model.blocks[1].attn.qkv.weight)


def test_scheduler_rebinding_continues_the_curve() -> None:
    model = _model(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    new_optimizer = delink(model, optimizer)
    rebound = rebind_scheduler(scheduler, new_optimizer)
    assert new_optimizer.param_groups[0]["lr"] == pytest.approx(1 / 4)
    new_optimizer.step()
    rebound.step()
    assert new_optimizer.param_groups[0]["lr"] == pytest.approx(1 / 5)


class UserModel(nn.Module):
    """A model that is not M6: just the block-sequence contract."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.layer_to_block = [0, 0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in self.layer_to_block:
            x = torch.tanh(self.blocks[index](x))
        return x


def test_any_model_with_the_contract_can_be_delinked() -> None:
    model = UserModel()
    x = torch.randn(4, 8)
    before = model(x)
    optimizer = delink(model, torch.optim.Adam(model.parameters()))
    assert len(model.blocks) == 3 and model.layer_to_block == [0, 1, 2]
    torch.testing.assert_close(model(x), before)
    assert len(optimizer.param_groups[0]["params"]) == 6


@pytest.mark.parametrize(
    ("blocks", "target", "message"),
    [(4, None, "already real"), (1, 3, "divide"), (2, 1, "multiple"), (2, 2, "multiple")],
)
def test_bad_targets_are_rejected(blocks: int, target: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        delink(_model(blocks), num_unique_blocks=target)


def test_unsupported_optimizer_and_policy_and_model() -> None:
    model = _model(1)
    with pytest.raises(ValueError, match="RMSprop"):
        delink(model, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="optimizer_state"):
        delink(model, optimizer_state="halve")
    with pytest.raises(ValueError, match="block sequence"):
        delink(nn.Linear(2, 2))
    assert len(model.blocks) == 1  # nothing changed by the refused calls


def test_interleaved_sharing_delinks_fully_but_not_into_groups() -> None:
    model = UserModel()
    model.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    model.layer_to_block = [0, 1] * 4
    with pytest.raises(ValueError, match=r"cannot be delinked into 4 blocks in the 'sequence' layout"):
        delink(model, num_unique_blocks=4)  # layers 0 and 1 would have to share one copy
    assert len(model.blocks) == 2
    x = torch.randn(3, 8)
    before = model(x)
    model.sharing = "cycle"  # a model that says its layout is cycled delinks into groups that keep it
    delink(model, num_unique_blocks=4)
    assert model.layer_to_block == [0, 1, 2, 3] * 2
    torch.testing.assert_close(model(x), before)
    delink(model)
    torch.testing.assert_close(model(x), before)


def test_cycled_sharing_runs_the_blocks_in_turn_and_delinks_in_stages_keeping_the_function() -> None:
    model = _model(1, layers=8, sharing="cycle").eval()
    assert M6Config(num_layers=6, num_unique_blocks=3, sharing="cycle").layer_to_block == [0, 1, 2, 0, 1, 2]
    assert M6Config(num_layers=6, num_unique_blocks=3).layer_to_block == [0, 0, 1, 1, 2, 2]
    tokens = torch.randint(0, 64, (3, 16))
    before = model(tokens).logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for target, expected in ((2, [0, 1] * 4), (4, [0, 1, 2, 3] * 2), (8, list(range(8)))):
        blocks_before = [model.blocks[b] for b in model.layer_to_block]
        optimizer = delink(model, optimizer, num_unique_blocks=target)
        assert model.layer_to_block == expected and model.config.num_unique_blocks == target
        # New block j copies the old block that its layers ran (j mod the old count).
        for layer, block in enumerate(model.layer_to_block):
            for new, old in zip(model.blocks[block].parameters(), blocks_before[layer].parameters()):
                assert torch.equal(new, old)
        torch.testing.assert_close(model(tokens).logits, before, atol=1e-6, rtol=0)
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_composite_schedulers_are_rebound_with_their_children() -> None:
    model = _model(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)], milestones=[2])
    new_optimizer = delink(model, optimizer)
    rebound = rebind_scheduler(scheduler, new_optimizer)
    for _ in range(4):
        new_optimizer.step()
        rebound.step()
    assert new_optimizer.param_groups[0]["lr"] == pytest.approx(rebound.get_last_lr()[0])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # the old optimizer is left alone


def test_delink_noise_breaks_the_copies_symmetry_reproducibly() -> None:
    from lightning_p2r.sharing import Perturbation

    def delinked(perturb):
        torch.manual_seed(0)
        model = _model(1, layers=4).eval()
        delink(model, perturb=perturb)
        return model

    exact, noisy, again = delinked(None), delinked(Perturbation(0.01, seed=3)), delinked(Perturbation(0.01, seed=3))
    other_seed = delinked(Perturbation(0.01, seed=4))
    for (name, a), b, c, d in zip(exact.blocks.named_parameters(), noisy.blocks.parameters(),
                                  again.blocks.parameters(), other_seed.blocks.parameters()):
        assert torch.equal(b, c), name  # same seed, same noise (every rank draws alike)
        if not a.any():
            assert torch.equal(a, b), name  # relative to the RMS: a zero tensor (a fresh bias) stays zero
            continue
        assert not torch.equal(b, d), name
        relative = (b - a).float().square().mean().sqrt() / a.float().square().mean().sqrt()
        assert 0.005 < float(relative) < 0.02, (name, float(relative))  # about 1% of the tensor's RMS
    first, second = noisy.blocks[0].attn.qkv.weight, noisy.blocks[1].attn.qkv.weight
    assert not torch.equal(first, second)  # each copy its own noise
    tokens = torch.randint(0, 64, (2, 16))
    drift = (noisy(tokens).logits - exact(tokens).logits).abs().max()
    assert 0 < float(drift) < 0.1  # the function moves a little: what the option costs
    with pytest.raises(ValueError, match="delink noise must be in"):
        Perturbation(1.5)
