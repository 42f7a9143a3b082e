"""Tensor / expert parallel options, the mesh arithmetic and the pure parts of the expert dispatch (one process)."""

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_p2r import P2RStrategy
from lightning_p2r.layout import Layout, ModelShape, ParallelDims, check_model
from lightning_p2r.strategy.parallel.clipping import clip_grad_norm_across_meshes
from lightning_p2r.strategy.parallel.experts import expert_major_order, rank_splits


def _with_world_size(strategy: P2RStrategy, world_size: int, rank: int = 0) -> P2RStrategy:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    strategy.cluster_environment = environment
    return strategy


@pytest.mark.parametrize("kwargs", [{"tensor_parallel": 0}, {"expert_parallel": -2}, {"tensor_parallel": 1.5},
                                    {"expert_parallel": True}, {"tensor_parallel": "2"}])
def test_degrees_must_be_positive_integers(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"P2RStrategy.{name} must be a positive integer"):
        P2RStrategy(**kwargs)


@pytest.mark.parametrize(("world", "tp", "ep", "message"), [
    (4, 3, 1, r"tensor_parallel=3\) must divide the number of processes \(4\): use tensor_parallel in \[1, 2, 4\]"),
    (4, 2, 4, r"expert_parallel=4\) borrows ranks .* processes / tensor_parallel = 4 / 2 = 2"),
    (6, 2, 2, r"expert_parallel=2\) borrows ranks .* = 3: use expert_parallel in \[1, 3\]"),
])
def test_mesh_degrees_that_do_not_divide_are_refused(world: int, tp: int, ep: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(world, tp, ep)
    strategy = _with_world_size(P2RStrategy(tensor_parallel=tp, expert_parallel=ep), world)
    with pytest.raises(ValueError, match=message):
        strategy._check_path_options()  # at setup, before any process group exists


def test_mesh_arithmetic() -> None:
    dims = ParallelDims(8, tensor_parallel=2, expert_parallel=2)
    assert (dims.data_parallel, dims.expert_data_parallel) == (4, 2)
    # Tensor-parallel ranks are adjacent and read the same batch.
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "data 4 (of which expert 2 x expert-data 2) x tensor 2" in dims.describe()


@pytest.mark.parametrize(("model", "message"), [
    ({"num_heads": 5, "num_experts": 4, "vocab_size": 256, "moe": True}, r"num_heads=5 must be divisible"),
    ({"num_heads": 4, "num_experts": 4, "vocab_size": 255, "moe": True}, r"vocab_size=255 must be divisible"),
    ({"num_heads": 4, "num_experts": 6, "vocab_size": 256, "moe": True}, r"num_experts=6 must be divisible"),
    ({"num_heads": 4, "num_experts": 4, "vocab_size": 256, "moe": False}, r"needs MoE layers"),
])
def test_a_model_the_mesh_cannot_split_is_refused(model: dict, message: str) -> None:
    layout = Layout(tensor_parallel=2, expert_parallel=4)
    with pytest.raises(ValueError, match=message):
        check_model(layout, ModelShape(num_layers=4, **model), devices=8)


def test_model_parallel_runs_on_its_engine_and_samples_by_data_rank() -> None:
    strategy = _with_world_size(P2RStrategy(tensor_parallel=2, sharding="zero3"), 4, rank=3)
    assert strategy.path == "model_parallel"
    # Rank 3 is the second rank of the second tensor-parallel pair: it reads data shard 1 of 2.
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert _with_world_size(P2RStrategy(sharding="zero3"), 4).path == "fsdp"


def test_zero1_is_accepted_with_tensor_and_expert_parallelism_and_refused_inside_pipeline_stages() -> None:
    _with_world_size(P2RStrategy(expert_parallel=2, sharding="zero1"), 2)._check_path_options()
    _with_world_size(P2RStrategy(tensor_parallel=2, sharding="zero1"), 4)._check_path_options()
    staged = _with_world_size(P2RStrategy(expert_parallel=2, pipeline_parallel=2, micro_batches=2,
                                          sharding="zero1"), 4)
    with pytest.raises(ValueError, match="use sharding='zero2'"):
        staged._check_path_options()


def test_rows_go_to_the_rank_that_holds_their_expert() -> None:
    # 6 experts over 3 ranks: rank j holds experts 2j and 2j + 1.
    assert rank_splits([1, 2, 0, 4, 3, 0], 3) == [3, 4, 3]


def test_received_rows_are_regrouped_by_local_expert() -> None:
    # From 2 source ranks, rows for 2 local experts: source 0 sent 1 row for expert 0 and 2 for expert 1, source 1
    # sent 2 for expert 0 and 0 for expert 1. Received order: s0e0, s0e1, s0e1, s1e0, s1e0.
    received = torch.tensor([[1, 2], [2, 0]])
    order = expert_major_order(received)
    assert order.tolist() == [0, 3, 4, 1, 2]  # expert 0 (from s0, then s1), then expert 1
    empty = expert_major_order(torch.zeros(2, 3, dtype=torch.long))
    assert empty.numel() == 0


def test_clipping_across_meshes_equals_torch_on_plain_tensors() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    expected = [p.grad.clone() for p in params]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, g in zip(copies, expected):
        c.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(copies, 1.0)
    total = clip_grad_norm_across_meshes(params, 1.0)
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected])))
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.grad, c.grad)
    assert total > 1.0  # the case that clips


def test_sequence_parallel_needs_tensor_parallel_rotary_positions_and_divisible_sequences() -> None:
    from lightning_p2r import M6Config
    from lightning_p2r.models import M6Transformer

    with pytest.raises(ValueError, match="set tensor_parallel > 1 as well"):
        P2RStrategy(sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        P2RStrategy(tensor_parallel=2, sequence_parallel="yes")
    small = {"vocab_size": 256, "dim": 32, "num_heads": 4, "num_layers": 2, "moe_layers": []}
    with torch.device("meta"):
        learned = M6Transformer(M6Config(**small, max_seq_len=16, position_embedding="learned"))
        odd = M6Transformer(M6Config(**small, max_seq_len=15))
        fine = M6Transformer(M6Config(**small, max_seq_len=16))
    # The strategy refuses the model at setup, before any parameter is placed.
    sequence = _with_world_size(P2RStrategy(tensor_parallel=2, sequence_parallel=True), 2)
    with pytest.raises(ValueError, match="needs the model's position_embedding='rotary'"):
        sequence.check_model_sizes(learned)
    with pytest.raises(ValueError, match="max_seq_len=15 must be divisible"):
        sequence.check_model_sizes(odd)
    sequence.check_model_sizes(fine)
    # Without sequence parallelism learned positions are fine.
    _with_world_size(P2RStrategy(tensor_parallel=2), 2).check_model_sizes(learned)


def test_the_plans_kinds_become_torchs_styles() -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_p2r.strategy.parallel.tensor import styles

    entries = {"a": "column", "b": "row", "n": "sequence", "e": "expert", "emb": "vocabulary", "head": "output"}
    plain = styles(entries)
    assert isinstance(plain["a"], ColwiseParallel) and isinstance(plain["b"], RowwiseParallel)
    assert isinstance(plain["emb"], RowwiseParallel) and plain["emb"].input_layouts == (Replicate(),)
    assert plain["head"].output_layouts == (Replicate(),)
    assert "n" not in plain and "e" not in plain  # whole without sequence parallelism
    split = styles(entries, sequence_parallel=True, loss_parallel=True)
    assert isinstance(split["n"], SequenceParallel) and isinstance(split["e"], PrepareModuleInput)
    assert split["a"].input_layouts == (Shard(1),) and split["b"].output_layouts == (Shard(1),)
    assert split["head"].output_layouts == (Shard(-1),)


def test_a_model_without_a_plan_or_with_a_wrong_one_is_refused_by_name() -> None:
    from lightning_p2r.protocols import ParallelPlan
    from lightning_p2r.strategy.parallel.parallelize import model_plan

    class Blocks(torch.nn.Module):
        def __init__(self, plan: ParallelPlan | None = None) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4))])
            self.layer_to_block = [0]
            if plan is not None:
                self.parallel_plan = lambda: plan

    with pytest.raises(ValueError, match="has no parallel_plan"):
        model_plan(Blocks())
    with pytest.raises(ValueError, match=r"names \['up'\] in block 0"):
        model_plan(Blocks(ParallelPlan(({"up": "column"},), {})))
    with pytest.raises(ValueError, match="as an expert layer"):
        model_plan(Blocks(ParallelPlan(({"0": "expert"},), {})))
    assert model_plan(Blocks(ParallelPlan(({"0": "column"},), {}))).blocks == ({"0": "column"},)


def test_the_strategy_checks_the_sizes_of_a_model_that_states_them_and_no_other() -> None:
    from types import SimpleNamespace

    from lightning_p2r import M6Config
    from lightning_p2r.models import M6Transformer
    from lightning_p2r.protocols import HoldsWeight, StatesSizes
    from lightning_p2r.strategy.pipeline.stage import AbsentModule

    strategy = _with_world_size(P2RStrategy(tensor_parallel=2), 2)
    with torch.device("meta"):
        odd_heads = M6Transformer(M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=48, num_heads=3))
    assert isinstance(odd_heads, StatesSizes)
    with pytest.raises(ValueError, match="num_heads=3 must be divisible"):
        strategy.check_model_sizes(odd_heads)
    # A config without the sizes (a user's model): nothing to check here, placement reads what it needs.
    strategy.check_model_sizes(SimpleNamespace(config=SimpleNamespace(num_heads=3)))
    assert isinstance(torch.nn.Linear(2, 2), HoldsWeight) and not isinstance(AbsentModule(), HoldsWeight)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_the_norm_of_bf16_gradients_keeps_fp32_precision(norm_type: float) -> None:
    """The pre-refactor clipping summed every gradient in fp64; torch's fused norm alone would round a bf16 group's
    norm to bf16 (about 3 digits). Checked against the float64 norm of the same bf16 values."""
    from lightning_p2r.strategy.parallel.clipping import total_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16)) for n in (100_003, 7, 4099)]
    for param in params:
        param.grad = (torch.randn(param.shape) * 3).to(torch.bfloat16)
    reference = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]), norm_type)
    torch.testing.assert_close(total_grad_norm(params, norm_type).double(), reference, rtol=1e-5, atol=0)
