import math

import pytest
import torch

from lightning_p2r.models import Block, M6Config, MoEFeedForward
from lightning_p2r.models.moe import expert_positions, load_balancing_loss, route_tokens


def _moe(**changes) -> MoEFeedForward:
    base = {"dim": 16, "ffn_hidden_dim": 32, "num_experts": 8, "moe_top_k": 1, "capacity_factor": 1.0}
    return MoEFeedForward(M6Config(**(base | changes)))


def _assignments(moe: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute routing the way the layer does: (experts, tokens, positions), token-major."""
    logits = x @ moe.router.weight.T
    gates, experts, _ = route_tokens(logits, moe.num_prototypes, moe.top_k)
    experts_flat = experts.reshape(-1)
    tokens_flat = torch.arange(x.shape[0]).view(-1, 1, 1).expand(-1, moe.num_prototypes, moe.top_k).reshape(-1)
    positions, _ = expert_positions(experts_flat, moe.num_experts)
    return experts_flat, tokens_flat, positions


@pytest.mark.parametrize(("top_k", "prototypes", "factor"), [(1, 1, 1.0), (2, 1, 0.5), (1, 4, 1.25), (2, 2, 0.3)])
def test_capacity_is_never_exceeded(top_k: int, prototypes: int, factor: float) -> None:
    moe = _moe(moe_top_k=top_k, num_prototypes=prototypes, capacity_factor=factor)
    with torch.no_grad():
        moe.router.weight.normal_(std=3.0)  # a skewed router, so capacity binds
    x = torch.randn(64, 16)
    experts, _, positions = _assignments(moe, x)
    capacity = min(math.ceil(factor * experts.numel() / moe.num_experts), 64)
    kept = positions < capacity
    per_expert = torch.bincount(experts[kept], minlength=moe.num_experts)
    assert int(per_expert.max()) <= capacity
    out = moe(x)
    expected_dropped = 1.0 - kept.float().mean()
    torch.testing.assert_close(out.stats.dropped_fraction, expected_dropped)
    assert torch.isfinite(out.output).all()
    if factor <= 1.0:
        assert float(out.stats.dropped_fraction) > 0


def test_dropped_tokens_pass_through_on_the_residual() -> None:
    config = M6Config(dim=16, num_heads=2, ffn_hidden_dim=32, num_experts=4, capacity_factor=0.25)
    block = Block(config, moe=True).eval()
    with torch.no_grad():
        block.ffn.router.weight.normal_(std=3.0)
    x = torch.randn(1, 32, 16)
    h = x + block.attn(block.attn_norm(x))
    experts, tokens, positions = _assignments(block.ffn, block.ffn_norm(h)[0])
    capacity = math.ceil(0.25 * experts.numel() / 4)
    dropped = tokens[positions >= capacity]
    assert dropped.numel() > 0
    out, moe = block(x)
    torch.testing.assert_close(out[0, dropped], h[0, dropped])
    kept = tokens[positions < capacity]
    assert not torch.allclose(out[0, kept], h[0, kept])
    assert torch.all(moe.output[0, dropped] == 0)


def test_dropless_drops_nothing() -> None:
    moe = _moe(capacity_factor=None, moe_top_k=2)
    with torch.no_grad():
        moe.router.weight.normal_(std=5.0)
    out = moe(torch.randn(128, 16))
    assert float(out.stats.dropped_fraction) == 0.0
    assert int(out.stats.tokens_per_expert.sum()) == 128 * 2


def test_balance_loss_is_one_for_a_uniform_router() -> None:
    for prototypes, top_k in [(1, 1), (1, 2), (4, 1)]:
        moe = _moe(num_prototypes=prototypes, moe_top_k=top_k)
        with torch.no_grad():
            moe.router.weight.zero_()
        out = moe(torch.randn(40, 16))
        torch.testing.assert_close(out.aux_loss, torch.tensor(1.0))
        # z-loss of all-zero logits is log(experts per group)^2
        torch.testing.assert_close(out.z_loss, torch.tensor(math.log(8 // prototypes) ** 2))


def test_balance_loss_grows_with_imbalance() -> None:
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2]]).view(2, 1, 2)
    skewed = load_balancing_loss(probs, torch.tensor([2, 0]))
    assert float(skewed) > 1.0


@pytest.mark.parametrize(("top_k", "prototypes"), [(1, 1), (2, 2)])
def test_the_balance_loss_over_ranks_sums_once_per_call_and_counts_every_ranks_tokens(top_k: int,
                                                                                      prototypes: int) -> None:
    """The loss over the data ranks packs the probabilities' sums, the counts and the token count into one sum (each
    is a latency-bound collective of a few bytes). Two ranks that saw the same tokens (the sum doubles everything)
    give one process's loss and gradients on those tokens."""
    torch.manual_seed(0)
    moe = _moe(moe_top_k=top_k, num_prototypes=prototypes, capacity_factor=None)
    with torch.no_grad():
        moe.router.weight.normal_(std=0.5)
    x = torch.randn(40, 16)
    alone = moe(x).aux_loss
    (alone_grad,) = torch.autograd.grad(alone, moe.router.weight)
    calls = []

    def two_equal_ranks(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.dtype)
        return 2 * tensor

    moe.balance_over(two_equal_ranks)
    both = moe(x).aux_loss
    (both_grad,) = torch.autograd.grad(both, moe.router.weight)
    assert calls == [torch.float64]
    torch.testing.assert_close(both, alone)
    torch.testing.assert_close(both_grad, alone_grad)


def test_prototypes_equal_independent_top1_routers_on_slices() -> None:
    """M6-T: k prototypes of E/k experts each == k separate top-1 MoE layers over expert slices, summed."""
    k, experts, dim = 4, 8, 16
    moe = _moe(num_experts=experts, num_prototypes=k, moe_top_k=1, capacity_factor=None)
    x = torch.randn(50, dim)
    expected = torch.zeros_like(x)
    per = experts // k
    for p in range(k):
        part = _moe(num_experts=per, num_prototypes=1, moe_top_k=1, capacity_factor=None)
        with torch.no_grad():
            part.router.weight.copy_(moe.router.weight[p * per:(p + 1) * per])
            part.experts.w_in.copy_(moe.experts.w_in[p * per:(p + 1) * per])
            part.experts.w_out.copy_(moe.experts.w_out[p * per:(p + 1) * per])
        expected += part(x).output
    torch.testing.assert_close(moe(x).output, expected, atol=1e-5, rtol=1e-5)


def test_top1_output_matches_a_per_token_loop() -> None:
    moe = _moe(capacity_factor=None)
    x = torch.randn(20, 16)
    probs = (x @ moe.router.weight.T).softmax(-1)
    expected = torch.stack([
        probs[t].max() * (torch.nn.functional.gelu(x[t] @ moe.experts.w_in[e]) @ moe.experts.w_out[e])
        for t, e in enumerate(probs.argmax(-1).tolist())
    ])
    torch.testing.assert_close(moe(x).output, expected, atol=1e-5, rtol=1e-5)


def test_unused_experts_get_zero_gradients_and_gates_train_the_router() -> None:
    moe = _moe(num_experts=8, capacity_factor=None)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 10.0  # every token with positive sum picks expert 0
    x = torch.rand(16, 16)
    out = moe(x)
    out.output.sum().backward()  # the output alone: the router must learn through the gates
    assert moe.experts.w_in.grad is not None
    assert int(out.stats.tokens_per_expert[0]) == 16
    assert torch.all(moe.experts.w_in.grad[1:] == 0)
    assert moe.experts.w_in.grad[0].abs().sum() > 0
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_earlier_tokens_win_capacity() -> None:
    moe = _moe(num_experts=2, capacity_factor=0.5)  # one expert's slots: half the tokens / 2 experts * 0.5
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 10.0  # everyone wants expert 0
    x = torch.rand(16, 16)
    out = moe(x).output
    capacity = 4  # ceil(0.5 * 16 / 2)
    assert torch.all(out[:capacity].abs().sum(-1) > 0) and torch.all(out[capacity:] == 0)


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_dropping_is_causal(top_k: int) -> None:
    from lightning_p2r import M6Transformer

    config = M6Config(vocab_size=64, max_seq_len=24, num_layers=2, dim=32, num_heads=4, num_experts=4,
                      moe_top_k=top_k, capacity_factor=0.5)
    model = M6Transformer(config).eval()
    tokens = torch.randint(0, 64, (1, 24))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(model(tokens).logits[:, :12], model(changed).logits[:, :12], atol=1e-6, rtol=0)


def test_moe_runs_under_bf16_autocast() -> None:
    moe = _moe()
    x = torch.randn(32, 16, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = moe(x)
        assert out.aux_loss.dtype == torch.float32 and out.z_loss.dtype == torch.float32
    (out.output.float().sum() + out.aux_loss).backward()
    assert moe.router.weight.grad is not None and torch.isfinite(x.grad).all()


def test_router_runs_in_fp32_under_bf16_input() -> None:
    moe = _moe().to(torch.bfloat16)
    out = moe(torch.randn(8, 16, dtype=torch.bfloat16))
    assert out.output.dtype == torch.bfloat16
    assert out.aux_loss.dtype == torch.float32 and out.z_loss.dtype == torch.float32


def test_stats_shape_and_balance_metric() -> None:
    moe = _moe(num_experts=4, capacity_factor=None)
    out = moe(torch.randn(2, 5, 16))
    assert out.output.shape == (2, 5, 16)
    assert out.stats.tokens_per_expert.shape == (4,)
    assert float(out.stats.load_max_over_mean) >= 1.0


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_dropping_is_causal_across_the_batch(top_k: int) -> None:
    """Changing any sequence's tokens from position t on leaves every sequence's logits before t unchanged, with
    capacity binding (position-major priority: a later token never displaces an earlier one in another row)."""
    from lightning_p2r.models import M6Transformer

    config = M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=32, num_heads=4, num_experts=4,
                      moe_top_k=top_k, capacity_factor=0.5, init_seed=1)
    model = M6Transformer(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.router.weight.normal_(std=2.0)  # a skewed router, so capacity binds
    tokens = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(tokens)
        assert max(float(s.dropped_fraction) for s in base.routing.values()) > 0.1
        for t in (3, 8, 13):
            changed = tokens.clone()
            changed[0, t:] = torch.randint(0, 64, (16 - t,), generator=torch.Generator().manual_seed(t))
            out = model(changed).logits
            assert torch.equal(out[:, :t], base.logits[:, :t]), t


def test_capacity_drops_spread_over_the_batch_rows() -> None:
    moe = _moe(capacity_factor=0.5)
    with torch.no_grad():
        moe.router.weight.normal_(std=3.0)
    x = torch.randn(8, 16, 16, generator=torch.Generator().manual_seed(0))
    from lightning_p2r.models.moe import expert_capacity, expert_positions, position_major_assignments

    with torch.no_grad():
        logits = torch.nn.functional.linear(x.reshape(-1, 16), moe.router.weight)
    experts = logits.argmax(-1)
    order = position_major_assignments(x.shape, 1, x.device)
    ranked, counts = expert_positions(experts[order], moe.num_experts)
    positions = torch.empty_like(ranked)
    positions[order] = ranked
    dropped = (positions >= expert_capacity(experts.numel(), moe.num_experts, 0.5, counts, experts.numel()))
    per_row = dropped.view(8, 16).float().mean(dim=1)
    assert per_row.max() - per_row.min() <= 0.25, per_row  # token-major priority dropped only the last rows


def test_gates_combine_expert_outputs_in_fp32_under_bf16_autocast() -> None:
    """The experts run in bf16 under autocast; their outputs are weighted by the fp32 gates in fp32 (issue 13 4c)."""
    moe = _moe(moe_top_k=2, capacity_factor=None)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    captured = {}
    original = moe.experts.forward

    def spy(rows, counts):
        out = original(rows, counts)
        captured["out"] = out
        return out

    moe.experts.forward = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = moe(x)
    assert captured["out"].dtype == torch.bfloat16 and result.output.dtype == torch.float32
    logits = torch.nn.functional.linear(x, moe.router.weight)
    gates, experts, _ = route_tokens(logits, 1, 2)
    order = torch.argsort(experts.reshape(-1), stable=True)
    tokens = torch.arange(32).repeat_interleave(2)[order]
    expected = torch.zeros(32, 16).index_add(0, tokens, captured["out"].float() * gates.reshape(-1)[order, None])
    assert torch.equal(result.output, expected)


@pytest.mark.parametrize("prototypes", [1, 2])
def test_normalize_gates_makes_the_k_gates_sum_to_one(prototypes: int) -> None:
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    raw, experts, _ = route_tokens(logits, prototypes, 2)
    normalized, same_experts, _ = route_tokens(logits, prototypes, 2, normalize=True)
    assert torch.equal(experts, same_experts)
    torch.testing.assert_close(normalized.sum(-1), torch.ones(64, prototypes))
    assert (raw.sum(-1) < 1).all()  # the default keeps the raw probabilities
    torch.testing.assert_close(normalized, raw / raw.sum(-1, keepdim=True))
    moe = _moe(moe_top_k=2, num_prototypes=prototypes, normalize_gates=True, capacity_factor=None)
    assert moe(torch.randn(16, 16)).output.shape == (16, 16)
