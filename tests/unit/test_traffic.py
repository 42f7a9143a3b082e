"""The tensor / expert / data parallel byte formulas on hand-computed cases (the distributed test checks them
against the counted collectives)."""

import pytest

from lightning_p2r.planning.traffic import (
    StepShape,
    balance_loss_bytes,
    data_parallel_bytes,
    expert_parallel_bytes,
    tensor_parallel_bytes,
)
from lightning_p2r.strategy.accounting import collective_payload

# 10 tokens, width 4, vocab 16; 3 layers of which 1 MoE with 8 experts, 2 assignments per token; fp32.
SHAPE = StepShape(tokens=10, dim=4, vocab_size=16, num_layers=3, moe_layers=1, num_experts=8,
                  assignments_per_token=2)


def test_tensor_parallel_bytes_by_hand() -> None:
    # Attention 3 layers x 2 + dense FFN 2 layers x 2 + embedding and head input 2 = 12 all-reduces of 10 x 4 fp32
    # (1920 bytes); the MoE layer 2 x 20 rows x 4 fp32 = 640; the loss's 3 x 10 fp32 = 120, or without loss
    # parallel the logits 10 x 16 fp32 = 640 gathered.
    assert tensor_parallel_bytes(SHAPE, 2) == {"all_reduce": 1920 + 640 + 120, "all_gather": 0}
    assert tensor_parallel_bytes(SHAPE, 2, loss_parallel=False) == {"all_reduce": 1920 + 640, "all_gather": 640}
    assert tensor_parallel_bytes(SHAPE, 1) == {"all_reduce": 0, "all_gather": 0}
    # Under expert parallelism a rank computes the rows it received.
    assert tensor_parallel_bytes(SHAPE, 4, moe_rows_per_layer=5)["all_reduce"] == 1920 + 2 * 5 * 4 * 4 + 120


def test_expert_parallel_bytes_by_hand() -> None:
    # 4 x 20 rows x 4 fp32 (out and back, forward and backward) + the 8 int64 counts.
    assert expert_parallel_bytes(SHAPE, 2) == {"all_to_all": 4 * 20 * 4 * 4 + 64}
    assert expert_parallel_bytes(SHAPE, 1) == {"all_to_all": 0}


def test_balance_loss_and_data_parallel_bytes_by_hand() -> None:
    assert balance_loss_bytes(SHAPE, 2) == {"all_reduce": 2 * 8 * (2 * 8 + 1)}
    # On gloo the small sums are gathered: each rank's tensor from every rank.
    assert balance_loss_bytes(SHAPE, 4, gloo=True) == {"all_gather": 4 * 2 * 8 * (2 * 8 + 1)}
    huge = StepShape(**{**vars(SHAPE), "num_experts": 8192})
    assert balance_loss_bytes(huge, 4, gloo=True) == {"all_reduce": 2 * 8 * (2 * 8192 + 1)}
    assert balance_loss_bytes(SHAPE, 1) == {"all_reduce": 0}
    assert data_parallel_bytes("replicate", block_bytes=100, root_bytes=10) == {
        "all_reduce": 110, "all_gather": 0, "reduce_scatter": 0}
    assert data_parallel_bytes("zero2", block_bytes=100, root_bytes=10)["all_gather"] == 110
    assert data_parallel_bytes("zero3", block_bytes=100, root_bytes=10) == {
        "all_reduce": 0, "all_gather": 210, "reduce_scatter": 110}
    with pytest.raises(ValueError, match="FSDP2 mode must be"):
        data_parallel_bytes("zero1", block_bytes=1, root_bytes=1)


def test_collective_payloads() -> None:
    import torch

    x = torch.zeros(6)  # 24 bytes
    assert collective_payload("_c10d_functional", "all_gather_into_tensor", (x, 4, "g"), {}) == ("all_gather", 96)
    assert collective_payload("_c10d_functional", "all_reduce", (x, "sum", "g"), {}) == ("all_reduce", 24)
    assert collective_payload("c10d", "alltoall_base_", (torch.zeros(2), x, None, [], []), {}) == ("all_to_all", 24)
    assert collective_payload("c10d", "allreduce_", ([x],), {}) == ("all_reduce", 24)


def test_sequence_parallel_bytes_by_hand() -> None:
    # 12 activation all-reduces of 160 bytes become 12 reduce-scatters and 12 all-gathers (1920 each); the MoE
    # layer adds 2 gathers (320); the experts' 640 and the loss's 120 stay all-reduces, plus the norms' gradients:
    # 4 x (4 x 4 x 3 blocks + 2 x 4) = 224.
    assert tensor_parallel_bytes(SHAPE, 2, sequence_parallel=True) == {
        "all_reduce": 640 + 120 + 224, "all_gather": 1920 + 320, "reduce_scatter": 1920}
    two_blocks = StepShape(**{**vars(SHAPE), "num_blocks": 2})
    assert tensor_parallel_bytes(two_blocks, 2, sequence_parallel=True)["all_reduce"] == 640 + 120 + 4 * (32 + 8)


def test_recompute_moves_the_layers_forward_collectives_again_by_hand() -> None:
    # The forward's share once more: tensor parallel's 5 layer reductions (3 attention, 2 dense FFN) of 160 bytes
    # and half the experts' 640; expert parallel's rows out and back (2 x 320) and the counts (64); the balance
    # loss's forward reduction (8 x (2 x 8 + 1)). The embedding, head and loss are not recomputed.
    assert tensor_parallel_bytes(SHAPE, 2, forward_passes=2) == {
        "all_reduce": 1920 + 800 + 640 + 320 + 120, "all_gather": 0}
    assert tensor_parallel_bytes(SHAPE, 2, sequence_parallel=True, forward_passes=2) == {
        "all_reduce": 960 + 120 + 224, "all_gather": 1920 + 320 + 800 + 160, "reduce_scatter": 1920 + 800}
    assert expert_parallel_bytes(SHAPE, 2, forward_passes=2) == {"all_to_all": 6 * 320 + 2 * 64}
    assert balance_loss_bytes(SHAPE, 2, forward_passes=2) == {"all_reduce": 3 * 8 * (2 * 8 + 1)}


def test_the_planner_gathers_the_sums_the_strategy_gathers() -> None:
    from lightning_p2r.planning.traffic import GATHERED_SUM_BYTES
    from lightning_p2r.strategy.parallel.differentiable import GATHERED_SUM_BYTES as STRATEGY_GATHERED_SUM_BYTES

    assert GATHERED_SUM_BYTES == STRATEGY_GATHERED_SUM_BYTES
