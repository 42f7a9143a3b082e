"""Pipeline parallelism's pure parts: options, the stage cut, replicas, the bubble formula, the loss attached to
hidden states, and the stage module on one process."""

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_p2r import M6Config, M6LanguageModel, P2RStrategy
from lightning_p2r.layout import (
    StageCut,
    block_holders,
    bubble_fraction,
    check_local_sharing,
    check_micro_batches,
)
from lightning_p2r.strategy.pipeline.stage import PipelineStageModule, attach_loss


def _with_world_size(strategy: P2RStrategy, world_size: int, rank: int = 0) -> P2RStrategy:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    strategy.cluster_environment = environment
    strategy.parallel_devices = [torch.device("cpu")] * world_size
    return strategy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline_parallel": 0}, "pipeline_parallel must be a positive integer"),
    ({"pipeline_parallel": 2, "stages_per_rank": 0, "micro_batches": 2}, "stages_per_rank must be a positive"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "zigzag", "micro_batches": 2}, "pipeline_schedule must be one of"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "stages_per_rank": 2, "micro_batches": 2},
     "runs one stage per rank"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "micro_batches": 2},
     "set stages_per_rank > 1"),
    ({"stages_per_rank": 2, "pipeline_schedule": "looped_bfs"}, "set pipeline_parallel > 1"),
    ({"pipeline_parallel": 4, "micro_batches": 2}, "micro_batches=2. is fewer than pipeline_parallel=4"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "stages_per_rank": 2, "micro_batches": 3},
     "must be a multiple"),
])
def test_bad_pipeline_options_are_refused_when_the_strategy_is_built(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P2RStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline_parallel": 2, "micro_batches": 2, "accumulation": "layered"}, "pipeline_schedule='looped_bfs'"),
    ({"pipeline_parallel": 2, "micro_batches": 2, "reduce_every_micro_batch": True}, "does not apply"),
])
def test_bad_pipeline_combinations_are_refused_before_any_process_group(kwargs: dict, message: str) -> None:
    strategy = _with_world_size(P2RStrategy(**kwargs), 2)
    with pytest.raises(ValueError, match=message):
        strategy._check_path_options()


@pytest.mark.parametrize(("world", "kwargs", "message"), [
    (3, {}, r"pipeline_parallel=2\) must divide the number of processes \(3\)"),
    (6, {"tensor_parallel": 2}, r"tensor_parallel=2\) must divide processes / pipeline_parallel = 3"),
    (4, {"expert_parallel": 4}, r"processes / \(tensor_parallel x pipeline_parallel\) = 4 / 2 = 2"),
])
def test_degrees_that_do_not_divide_the_stages_are_refused(world: int, kwargs: dict, message: str) -> None:
    strategy = _with_world_size(P2RStrategy(pipeline_parallel=2, micro_batches=2, **kwargs), world)
    with pytest.raises(ValueError, match=message):
        strategy._check_path_options()


def test_a_pipeline_of_tensor_parallel_stages_samples_by_data_rank() -> None:
    # 8 ranks = pipeline 2 x data 2 x tensor 2: rank 6 is stage 1, data rank 1, tensor rank 0.
    strategy = _with_world_size(P2RStrategy(pipeline_parallel=2, tensor_parallel=2, micro_batches=2), 8, rank=6)
    assert strategy.path == "pipeline"
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_pipeline_runs_on_its_engine_and_samples_by_data_rank() -> None:
    strategy = _with_world_size(P2RStrategy(pipeline_parallel=2, micro_batches=2, sharding="zero3"), 4, rank=3)
    assert strategy.path == "pipeline"
    # Ranks are (pipeline, data): rank 3 is stage group 1's second data rank and reads data shard 1 of 2.
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert strategy.micro_batches == 2 and strategy.accumulation == "standard"


def test_layers_that_do_not_divide_into_stages_are_refused() -> None:
    with pytest.raises(ValueError, match=r"6 layers cannot be cut into .* 2 \* 2 = 4 stages.*\[1, 2, 3, 6\]"):
        StageCut(world_size=2, pipeline_parallel=2, stages_per_rank=2, num_layers=6)


def test_the_looped_cut_assigns_stages_round_robin() -> None:
    cut = StageCut(world_size=4, pipeline_parallel=2, stages_per_rank=2, num_layers=8)
    assert cut.num_stages == 4 and cut.ranks_per_stage == 2 and cut.layers_per_stage == 2
    assert cut.stages_of(0) == [0, 2] and cut.stages_of(1) == [1, 3]
    assert [cut.owner(s) for s in range(4)] == [0, 1, 0, 1]
    assert list(cut.stage_layers(3)) == [6, 7]
    assert [cut.pipeline_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [cut.column(r) for r in range(4)] == [0, 1, 0, 1]
    assert cut.global_ranks([0, 1], column=1) == [1, 3]


def test_a_shared_block_is_held_by_every_rank_whose_stages_run_it() -> None:
    cut = StageCut(world_size=2, pipeline_parallel=2, stages_per_rank=1, num_layers=4)
    assert block_holders([0, 0, 0, 0], cut) == {0: (0, 1)}  # pseudo model: a replica on both ranks
    assert block_holders([0, 0, 1, 1], cut) == {0: (0,), 1: (1,)}
    assert block_holders([0, 1, 0, 1], cut) == {0: (0, 1), 1: (0, 1)}  # "cycle" sharing
    looped = StageCut(world_size=2, pipeline_parallel=2, stages_per_rank=2, num_layers=4)
    with pytest.raises(ValueError, match="stages_per_rank=1"):
        check_local_sharing([0, 0, 0, 0], looped)
    check_local_sharing([0, 1, 2, 3], looped)


def test_micro_batches_must_fill_the_pipeline() -> None:
    check_micro_batches("1f1b", 4, 4)
    with pytest.raises(ValueError, match="fewer than pipeline_parallel"):
        check_micro_batches("gpipe", 1, 2)


def test_bubble_formula() -> None:
    assert bubble_fraction(1, 1, 8) == 0
    assert bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 2, 4) == pytest.approx(3 / 11)  # looping halves the idle stage-times' share
    assert bubble_fraction(2, 1, 8) == pytest.approx(1 / 9)


def test_an_attached_loss_gets_gradient_one_and_leaves_the_hidden_states_alone() -> None:
    hidden = torch.randn(2, 3, requires_grad=True)
    weight = torch.tensor(2.0, requires_grad=True)
    extra = weight * 3.0
    out = attach_loss(hidden, extra)
    assert torch.equal(out, hidden)
    assert not out._is_view()  # a stage returns it: FSDP2 warns about (and hooks can miss) a view output
    (out * 5).sum().backward()
    assert torch.equal(hidden.grad, torch.full((2, 3), 5.0))
    assert weight.grad == 3.0  # d(extra)/d(weight), with extra's own gradient one: as if added to the loss


@pytest.mark.parametrize("recompute", [False, True])
def test_stages_chained_on_one_process_give_the_model_loss(recompute: bool) -> None:
    """Two stage modules run one after the other (no pipeline): the last returns the layered stages' loss, which
    with the attached router losses backpropagates the gradient of the module's own total loss; with recompute the
    layers run again in backward, with the same dropout masks."""
    config = M6Config(vocab_size=64, dim=16, num_heads=2, num_layers=4, max_seq_len=8, moe_layers=[1, 3],
                      num_experts=2, capacity_factor=None, router_aux_loss_coef=0.3, dropout=0.1, init_seed=3)
    module = M6LanguageModel(config)
    module.configure_model()
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    expected = module.losses(batch)["loss"]
    expected.backward()
    reference = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    parts = module.pipeline_parts()
    holder = module.transformer
    stages = [PipelineStageModule(parts, holder.blocks, range(0, 2), first=True, last=False, recompute=recompute,
                                  embed_modules=parts.embed_modules, head_modules=parts.head_modules),
              PipelineStageModule(parts, holder.blocks, range(2, 4), first=False, last=True, recompute=recompute,
                                  embed_modules=parts.embed_modules, head_modules=parts.head_modules)]
    for stage in stages:
        stage.begin(computes_loss=True, micro_batches=1, infers_shapes=False)
    torch.manual_seed(5)  # the same dropout masks as the whole model's forward
    ce = stages[1](stages[0](tokens=batch), tokens=batch)
    ce.backward()
    context = stages[0].step_contexts()[0]
    parts.absorb(context, parts.records(stages[1].step_contexts()[0]))
    assert parts.metrics(ce, context)["loss"] == pytest.approx(float(expected.detach()), rel=1e-6)
    for name, param in module.named_parameters():
        assert torch.allclose(param.grad, reference[name], atol=1e-6), name


def test_a_rank_keeps_only_its_blocks_and_ends_before_anything_is_allocated() -> None:
    from lightning_p2r.models import M6Transformer
    from lightning_p2r.strategy.pipeline.stage import AbsentModule, keep_only

    with torch.device("meta"):
        model = M6Transformer(M6Config(vocab_size=64, dim=16, num_heads=2, num_layers=4, max_seq_len=8))
    keep_only(model, {2, 3}, [model.norm, model.lm_head, model.tok_embeddings])  # the last stage, tied embedding
    assert [isinstance(b, AbsentModule) for b in model.blocks] == [True, True, False, False]
    assert not isinstance(model.tok_embeddings, AbsentModule) and model.lm_head.weight is model.tok_embeddings.weight
    keep_only(model, {2}, [])  # a middle stage: no embedding, no head
    assert isinstance(model.norm, AbsentModule) and isinstance(model.lm_head, AbsentModule)
    assert {n.split(".")[1] for n, _ in model.named_parameters()} == {"2"}
    with pytest.raises(RuntimeError, match="another pipeline rank"):
        model.blocks[0](torch.zeros(1))


def test_replicas_are_summed_in_one_flat_all_reduce_per_dtype(tmp_path) -> None:
    import torch.distributed as dist

    from lightning_p2r.strategy.pipeline.rank_stages import sum_over

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tensors = [torch.ones(2, 3), torch.arange(4.0), torch.ones(2, dtype=torch.float64)]
        before = [t.clone() for t in tensors]
        sum_over(dist.group.WORLD, tensors)  # one rank: the sum is the tensor itself, written back in place
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("kwargs", "ranks"), [({"pipeline_parallel": 2, "micro_batches": 2}, 2),
                                               ({"tensor_parallel": 2}, 2), ({}, 4)])
def test_tokens_per_second_count_each_batch_once(kwargs: dict, ranks: int) -> None:
    """The pipeline's (and a tensor-parallel group's) ranks read the same batch: logged throughput counts the data
    ranks, not every rank."""
    from types import SimpleNamespace

    from lightning_p2r.module import data_ranks

    strategy = _with_world_size(P2RStrategy(**kwargs), 4)
    assert data_ranks(SimpleNamespace(strategy=strategy, world_size=4)) == ranks


def test_every_schedule_name_is_torchs_and_the_single_stage_ones_agree_with_the_rulebook() -> None:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from lightning_p2r.layout import PIPELINE_SCHEDULES, SINGLE_STAGE_SCHEDULES
    from lightning_p2r.strategy.pipeline.runner import schedule_class

    classes = {name: schedule_class(name) for name in PIPELINE_SCHEDULES}
    assert [cls.__name__ for cls in classes.values()] == [
        "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"]
    single = {name for name, cls in classes.items() if issubclass(cls, PipelineScheduleSingle)}
    assert single == set(SINGLE_STAGE_SCHEDULES)
