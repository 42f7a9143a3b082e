"""Engines on a hand-made context: no strategy, no Trainer, no process group."""

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from lightning_p2r import M6Config, M6Transformer
from lightning_p2r.strategy.engines import FSDP2Engine, LocalEngine, engine_for
from lightning_p2r.strategy.engines.base import EngineContext
from lightning_p2r.strategy.options import AccumulationConfig, OffloadConfig, ParallelConfig, ShardingConfig

CONFIG = M6Config(vocab_size=64, max_seq_len=16, num_layers=4, dim=32, num_heads=4, moe_layers=[], init_seed=3)


def context(*, offload: OffloadConfig | None = None, parallel: ParallelConfig | None = None, world_size: int = 1,
            rank: int = 0) -> EngineContext:
    return EngineContext(sharding=ShardingConfig(), parallel=parallel or ParallelConfig(),
                         accumulation=AccumulationConfig(), offload=offload or OffloadConfig(),
                         device=torch.device("cpu"), world_size=world_size, global_rank=rank)


def test_the_context_is_immutable() -> None:
    ctx = context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.world_size = 2  # type: ignore[misc]


def test_engine_for_maps_every_path() -> None:
    assert isinstance(engine_for("local"), LocalEngine)
    for path in ("fsdp", "model_parallel", "pipeline"):
        engine = engine_for(path)
        assert isinstance(engine, FSDP2Engine) and engine.path == path


def test_the_local_engine_places_a_meta_model_and_returns_its_plan() -> None:
    with torch.device("meta"):
        model = M6Transformer(CONFIG)
    engine = LocalEngine()
    placed = engine.place(model, context(offload=OffloadConfig(offload_fraction=0.5)))
    assert placed.plan.offloaded == (1, 3)  # the rulebook's spread: the last block among them
    assert not any(p.is_meta for p in model.parameters())
    assert engine.offload_streamer() is not None
    assert not hasattr(engine, "strategy")
    # Same seed, same names: the values do not depend on the placement.
    reference = M6Transformer(CONFIG)
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        if ours.numel():
            torch.testing.assert_close(ours, theirs, msg=name)


def test_the_fsdp2_engine_refuses_what_fsdp2_offload_cannot_hold() -> None:
    ctx = context(offload=OffloadConfig(offload_fraction=0.5, offload_states=["grads", "optimizer"]), world_size=2)
    with pytest.raises(ValueError, match="offload_states must include 'params'"):
        FSDP2Engine("fsdp").check_options(ctx)


class _StateDict(dict):
    """A state dict that a weak reference can watch (a plain dict cannot be weakly referenced)."""


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("engine_class", [LocalEngine, FSDP2Engine])
def test_an_engine_keeps_no_reference_to_the_checkpoint_weights_after_placing(request, engine_class: type) -> None:
    reference = M6Transformer(CONFIG)
    weights = _StateDict({name: value.clone() + 1 for name, value in reference.state_dict().items()})
    watch = weakref.ref(weights)
    with torch.device("meta"):
        model = M6Transformer(CONFIG)
    engine = engine_class()
    ctx = dataclasses.replace(context(), weights=(weights, True))
    if engine_class is FSDP2Engine:  # FSDP2's replicate layout on one process (shards of one rank)
        request.getfixturevalue("process_group")
        engine.setup_environment(ctx)
    engine.place(model, ctx)
    engine.load_weights(model, *ctx.weights)  # as the strategy does right after placing
    expected = reference.state_dict()["tok_embeddings.weight"] + 1  # (loading may convert the dict's own values)
    torch.testing.assert_close(_local(model.state_dict()["tok_embeddings.weight"]), expected)
    assert engine.ctx.weights is None
    del weights, ctx
    gc.collect()
    assert watch() is None  # a whole model's state dict does not stay alive for the rest of the run


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


@pytest.mark.parametrize("accumulation", ["standard", "layered"])
def test_the_fsdp2_engine_takes_every_reshard_decision_from_the_rulebook(process_group, monkeypatch,
                                                                          accumulation: str) -> None:
    """The units' own reshard-after-forward (placement) and layered accumulation's reshard after the last
    micro-batch (the engine's block events) both come from ``Layout.resharding``."""
    from lightning_p2r.strategy import placement

    decided: list[bool] = []
    real = placement.shard_unit
    monkeypatch.setattr(placement, "shard_unit", lambda unit, mesh, *, reshard, **kwargs: (
        decided.append(reshard), real(unit, mesh, reshard=reshard, **kwargs))[1])
    ctx = dataclasses.replace(context(), sharding=ShardingConfig(sharding="zero3"),
                              accumulation=AccumulationConfig(accumulation=accumulation,
                                                              micro_batches=2 if accumulation == "layered" else 1))
    rule = ctx.layout.resharding
    engine = FSDP2Engine("fsdp")
    engine.setup_environment(ctx)
    with torch.device("meta"):
        model = M6Transformer(CONFIG)
    engine.place(model, ctx)
    assert decided == [rule.after_each_forward] * len(model.blocks) == [accumulation == "standard"] * 4
    events = engine.block_events()
    assert (events.reshard_after_last if events is not None else False) == rule.after_last_micro_batch


def test_delinking_before_anything_is_placed_says_so() -> None:
    model = M6Transformer(CONFIG)
    with pytest.raises(RuntimeError, match="nothing is placed yet"):
        FSDP2Engine("fsdp").delink(model, torch.optim.SGD(model.parameters(), lr=0.1), context(), None, "reset")
