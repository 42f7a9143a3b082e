"""The grouped-GEMM expert kernel against the per-expert loop, and the MoE layer's host-synchronization count."""

import copy

import pytest
import torch

from lightning_p2r.measure.host_syncs import HostSyncCounter
from lightning_p2r.models import M6Config, MoEFeedForward
from lightning_p2r.models.moe import count_per_expert, expert_mlps, resolve_expert_kernel
from lightning_p2r.models.transformer import M6Transformer

CASES = {
    "top1 capacity": {"moe_top_k": 1, "capacity_factor": 1.25},
    "top2 dropless": {"moe_top_k": 2, "capacity_factor": None},
    "top2 tight capacity": {"moe_top_k": 2, "capacity_factor": 0.5},
    "prototypes": {"num_prototypes": 2, "moe_top_k": 1, "capacity_factor": 1.0},
    "shared ffn": {"num_unique_experts": 2, "moe_top_k": 2, "capacity_factor": None, "normalize_gates": True},
}


def _layer(kernel: str, seed: int = 0, **changes) -> MoEFeedForward:
    torch.manual_seed(seed)
    base = {"dim": 16, "ffn_hidden_dim": 32, "num_experts": 8, "expert_kernel": kernel}
    moe = MoEFeedForward(M6Config(**(base | changes)))
    with torch.no_grad():
        moe.router.weight.normal_(std=2.0)  # skewed, so tight capacities drop assignments
    return moe


def _run(moe: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_()
    out = moe(x)
    loss = (out.output * torch.linspace(-1, 1, out.output.numel()).view_as(out.output)).sum() + out.aux_loss
    loss.backward()
    return out.output.detach(), {name: p.grad.clone() for name, p in moe.named_parameters()}, x.grad


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_kernel_gives_the_loops_outputs_and_gradients(case: str) -> None:
    loop = _layer("loop", **CASES[case])
    grouped = _layer("grouped", **CASES[case])
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(1))
    out_loop, grads_loop, x_grad_loop = _run(loop, x)
    out_grouped, grads_grouped, x_grad_grouped = _run(grouped, x)
    torch.testing.assert_close(out_grouped, out_loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad_grouped, x_grad_loop, rtol=1e-5, atol=1e-6)
    for name, grad in grads_loop.items():
        torch.testing.assert_close(grads_grouped[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    if case == "top2 tight capacity":
        assert float(loop(x).stats.dropped_fraction) > 0.1  # the case does drop assignments


def test_grouped_kernel_under_bf16_autocast_matches_the_loop_within_bf16_rounding() -> None:
    loop = _layer("loop", moe_top_k=2, capacity_factor=1.0)
    grouped = copy.deepcopy(loop)
    grouped.experts.kernel = "grouped"
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = loop(x).output, grouped(x).output
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_rows_past_the_counted_ones_give_zeros_and_no_gradient() -> None:
    x = torch.randn(10, 4, requires_grad=True)
    w_in, w_out = torch.randn(3, 4, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
    counts = torch.tensor([2, 0, 5])  # 7 of the 10 rows are kept
    for kernel in ("loop", "grouped"):
        x.grad = None
        out = expert_mlps(x, counts, w_in, w_out, kernel=kernel)
        assert torch.equal(out[7:], torch.zeros(3, 4))
        out.backward(torch.ones_like(out))
        assert torch.equal(x.grad[7:], torch.zeros(3, 4)), kernel
        manual = torch.cat([torch.nn.functional.gelu(x[:2] @ w_in[0]) @ w_out[0],
                            torch.nn.functional.gelu(x[2:7] @ w_in[2]) @ w_out[2]])
        torch.testing.assert_close(out[:7], manual)


@pytest.mark.parametrize("case", ["top1 capacity", "top2 dropless", "prototypes"])
def test_the_grouped_moe_layer_makes_no_host_synchronization(case: str) -> None:
    x = torch.randn(2, 32, 16)
    grouped = _layer("grouped", **CASES[case])
    with HostSyncCounter() as counter:
        out = grouped(x)
        (out.output.sum() + out.aux_loss + out.z_loss).backward()
    assert counter.total == 0, counter.counts
    with HostSyncCounter() as counter:  # the counter does see the loop's host read of the segment sizes
        _layer("loop", **CASES[case])(x)
    assert counter.counts["tolist"] >= 1


def test_the_counter_sees_each_kind_of_synchronizing_call() -> None:
    values = torch.tensor([0, 3, 1, 3])
    with HostSyncCounter() as counter:
        values.max().item()
        values[values > 1]
        values.nonzero()
        torch.bincount(values)
        values.tolist()
    assert counter.counts == {"_local_scalar_dense": 1, "boolean index": 1, "nonzero": 1, "bincount": 1,
                              "tolist": 1}


def test_counts_per_expert_equal_bincount() -> None:
    ids = torch.randint(0, 7, (500,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(count_per_expert(ids, 9), torch.bincount(ids, minlength=9))


def test_auto_picks_grouped_only_for_bf16_on_cuda() -> None:
    x = torch.randn(2, 2)
    assert resolve_expert_kernel("auto", x) == "loop"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert resolve_expert_kernel("auto", x) == "loop"
    assert resolve_expert_kernel("grouped", x) == "grouped"


def test_an_m6_model_trains_the_same_with_either_kernel() -> None:
    losses = {}
    for kernel in ("loop", "grouped"):
        torch.manual_seed(0)
        config = M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=32, num_heads=4, num_experts=4,
                          moe_top_k=2, capacity_factor=1.0, expert_kernel=kernel)
        model = M6Transformer(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(4))
        losses[kernel] = []
        for _ in range(3):
            out = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
            (loss + 0.01 * out.aux_loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[kernel].append(float(loss))
    assert losses["loop"] == pytest.approx(losses["grouped"], rel=1e-5)


@pytest.mark.parametrize("attention", ["dense", "alternating", "local"])
def test_a_whole_m6_step_on_the_grouped_kernel_makes_no_host_synchronization(attention: str) -> None:
    config = M6Config(vocab_size=64, max_seq_len=64, num_layers=2, dim=32, num_heads=4, num_experts=4, moe_top_k=2,
                      expert_kernel="grouped", attention=attention, sparse_window=8)
    model = M6Transformer(config)
    tokens = torch.randint(0, 64, (2, 64))
    with HostSyncCounter() as counter:
        out = model(tokens)
        (out.logits.sum() + out.aux_loss + out.z_loss).backward()
    assert counter.total == 0, counter.counts
