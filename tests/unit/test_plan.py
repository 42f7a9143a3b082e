import pytest
import torch

from lightning_p2r import M6Config, M6Transformer
from lightning_p2r.layout import BlockFootprint, device_bytes_needed, parse_bytes, plan_offload, spread
from lightning_p2r.strategy.offload_plan import block_footprints


def test_spread_keeps_the_first_block_resident_and_interleaves() -> None:
    assert spread(0, 8) == ()
    assert spread(2, 4) == (1, 3)
    assert spread(4, 8) == (1, 3, 5, 7)
    assert spread(1, 8) == (7,)
    assert spread(8, 8) == tuple(range(8))
    assert spread(3, 4) == (0, 1, 3)


@pytest.mark.parametrize(("value", "expected"), [
    (1000, 1000), ("1000", 1000), ("12GB", 12 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GiB", int(1.5 * 2**30)),
    ("80%", 800), ("100%", 1000),
])
def test_parse_bytes(value, expected: int) -> None:
    assert parse_bytes(value, total=1000) == expected


@pytest.mark.parametrize("value", ["lots", "12XB", "0%", "150%", True])
def test_parse_bytes_rejects(value) -> None:
    with pytest.raises(ValueError, match="device_memory_budget"):
        parse_bytes(value, total=1000)


def test_footprints_count_params_grads_and_adam_state() -> None:
    model = M6Transformer(M6Config(vocab_size=64, num_layers=2, dim=32, num_heads=4, num_experts=2))
    footprint = block_footprints(model.blocks)[0]
    numel = sum(p.numel() for p in model.blocks[0].parameters())
    assert footprint == BlockFootprint(4 * numel, 4 * numel, 8 * numel)
    assert footprint.total == 16 * numel
    # precision="bf16-true" casts the module: its gradients and AdamW's two moments are bf16 too (4 bytes, not 8)
    assert block_footprints(model.blocks.to(torch.bfloat16))[0] == BlockFootprint(2 * numel, 2 * numel, 4 * numel)


def _blocks(n: int, size: int = 100) -> list[BlockFootprint]:
    return [BlockFootprint(size, size, 2 * size) for _ in range(n)]


def test_budget_plan_keeps_the_most_blocks_that_fit() -> None:
    blocks = _blocks(4)  # 400 bytes resident each, 200 while streamed
    assert plan_offload(4, budget_bytes=10_000, footprints=blocks).offloaded == ()
    # all resident: 1600 + other 100 = 1700; one offloaded: 1200 + stream(2 x 200 capped at 1 block) = 1500
    plan = plan_offload(4, budget_bytes=1600, footprints=blocks, other_bytes=100, prefetch=1)
    assert plan.offloaded == (3,) and plan.resident == (0, 1, 2)
    assert device_bytes_needed(blocks, plan.offloaded, 100, 0, 1) <= 1600
    everything = plan_offload(4, budget_bytes=500, footprints=blocks, other_bytes=100, prefetch=1)
    assert everything.offloaded == (0, 1, 2, 3)  # 100 + 2 x 200 streaming buffers


def test_budget_below_the_minimum_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="smaller than the least this model needs"):
        plan_offload(4, budget_bytes=400, footprints=_blocks(4), other_bytes=100, activation_bytes=50, prefetch=1)


def test_activation_allowance_and_prefetch_cost_budget() -> None:
    blocks = _blocks(4)
    roomy = plan_offload(4, budget_bytes=1300, footprints=blocks, prefetch=0)
    tight = plan_offload(4, budget_bytes=1300, footprints=blocks, prefetch=0, activation_bytes=400)
    assert len(tight.offloaded) > len(roomy.offloaded)


def test_fraction_and_explicit_plans() -> None:
    assert plan_offload(8, offload_fraction=0.25).offloaded == (3, 7)
    assert plan_offload(8, offload_blocks=[5, 1, 5]).offloaded == (1, 5)
    assert plan_offload(8).offloaded == ()
    with pytest.raises(ValueError, match="offload_blocks"):
        plan_offload(4, offload_blocks=[4])
    with pytest.raises(ValueError, match="one of"):
        plan_offload(4, offload_fraction=0.5, offload_blocks=[1])


def test_uneven_blocks_use_the_largest_streamed_block_for_buffers() -> None:
    blocks = [BlockFootprint(100, 100, 200), BlockFootprint(300, 300, 600)]
    assert device_bytes_needed(blocks, (1,), 0, 0, 1) == 400 + 600
