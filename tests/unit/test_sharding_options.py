"""P2RStrategy sharding and layered accumulation on one process: options, paths, errors and equivalence.

The multi-process checks (ZeRO stages against one process, collectives, checkpoints) are in tests/distributed.
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from equivalence import assert_trained_alike
from helpers import TINY, InitialWeights, tiny_data, tiny_trainer
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy
from lightning_p2r.measure.memory import ModelStateBytes, zero_formula_bytes

DENSE = TINY | {"moe_layers": [], "num_layers": 3}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sharding": "zero4"}, "sharding must be one of"),
    ({"accumulation": "breadth"}, "accumulation must be 'standard' or 'layered'"),
    ({"accumulation": "layered", "micro_batches": 0}, "micro_batches must be an integer >= 1"),
    ({"recompute": True}, "recompute applies to accumulation='layered'"),
    ({"micro_batches": 2}, "accumulate_grad_batches"),
])
def test_bad_options_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P2RStrategy(**kwargs)


def _with_world_size(strategy: P2RStrategy, world_size: int) -> P2RStrategy:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    strategy.cluster_environment = environment
    return strategy


@pytest.mark.parametrize(("kwargs", "world_size", "path", "mode"), [
    ({"sharding": "none"}, 1, "local", "replicate"), ({"sharding": "zero1"}, 1, "local", "replicate"),
    # Across processes "none" and "zero1" take DDP's reducer ("ddp"), or FSDP2's replicate layout with offload or
    # layered accumulation (DDP's reducer cannot drive them).
    ({"sharding": "none"}, 2, "ddp", "replicate"), ({"sharding": "zero1"}, 2, "ddp", "replicate"),
    ({"sharding": "zero2"}, 1, "fsdp", "zero2"), ({"sharding": "zero3"}, 2, "fsdp", "zero3"),
    ({"sharding": "none", "offload_fraction": 0.5}, 1, "local", "replicate"),
    ({"sharding": "none", "offload_fraction": 0.5}, 2, "fsdp", "replicate"),
    ({"sharding": "zero1", "accumulation": "layered", "micro_batches": 2}, 2, "fsdp", "replicate"),
])
def test_engine_follows_sharding_and_world_size(kwargs: dict, world_size: int, path: str, mode: str) -> None:
    strategy = _with_world_size(P2RStrategy(**kwargs), world_size)
    assert strategy.path == path
    assert strategy.fsdp_mode == mode
    assert strategy.is_distributed == (world_size > 1)


def test_zero1_with_offload_across_ranks_on_an_accelerator_is_refused() -> None:
    strategy = _with_world_size(P2RStrategy(sharding="zero1", offload_fraction=0.5), 2)
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]  # read only: no GPU needed
    with pytest.raises(ValueError, match="use sharding='zero2'"):
        strategy._check_path_options()


@pytest.mark.parametrize(("kwargs", "world_size"), [
    ({"sharding": "zero3", "offload_fraction": 0.5, "offload_states": ["grads", "optimizer"]}, 1),
    ({"sharding": "none", "offload_fraction": 0.5, "offload_states": ["grads", "optimizer"]}, 2),
])
def test_fsdp_offload_must_keep_parameters_on_the_host(kwargs: dict, world_size: int) -> None:
    strategy = _with_world_size(P2RStrategy(**kwargs), world_size)
    with pytest.raises(ValueError, match="offload_states must include 'params'"):
        strategy._check_path_options()


def test_layered_needs_lightning_accumulation_off(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, strategy=P2RStrategy(accumulation="layered", micro_batches=2),
                           accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="accumulate_grad_batches=1"):
        trainer.fit(M6LanguageModel(M6Config(**DENSE)), datamodule=tiny_data(tmp_path))


def test_layered_needs_a_module_that_declares_its_stages(tmp_path: Path) -> None:
    class NoStages(M6LanguageModel):
        layered_stages = None

    trainer = tiny_trainer(tmp_path, strategy=P2RStrategy(accumulation="layered", micro_batches=2))
    with pytest.raises(ValueError, match="layered_stages"):
        trainer.fit(NoStages(M6Config(**DENSE)), datamodule=tiny_data(tmp_path))


def _train(tmp_path: Path, strategy: P2RStrategy, batch_size: int, accumulate: int = 1
           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Initial and final weights of 3 steps."""
    L.seed_everything(3)
    module = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(lr=1e-2, warmup_steps=1, min_lr_ratio=1.0))
    initial = InitialWeights()
    trainer = tiny_trainer(tmp_path, strategy=strategy, max_steps=3, limit_val_batches=0,
                           accumulate_grad_batches=accumulate, callbacks=[initial])
    trainer.fit(module, datamodule=tiny_data(tmp_path, batch_size=batch_size))
    return initial.weights, {k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


@pytest.mark.parametrize("strategy_kwargs", [
    {"accumulation": "layered", "micro_batches": 4},
    {"accumulation": "layered", "micro_batches": 2, "recompute": True, "offload_blocks": [0, 2]},
])
def test_layered_equals_standard_accumulation_through_the_trainer(tmp_path: Path, strategy_kwargs: dict) -> None:
    """Layered accumulation sums each block's micro-batch gradients in another order: trained alike, not bit-exact."""
    initial, standard = _train(tmp_path / "standard", P2RStrategy(), batch_size=2,
                               accumulate=strategy_kwargs["micro_batches"])
    _, layered = _train(tmp_path / "layered", P2RStrategy(**strategy_kwargs),
                        batch_size=2 * strategy_kwargs["micro_batches"])
    assert_trained_alike(layered, standard, initial, name=str(strategy_kwargs))


def test_layered_offload_fetches_each_block_once_per_direction(tmp_path: Path) -> None:
    strategy = P2RStrategy(accumulation="layered", micro_batches=4, offload_fraction=1.0)
    _, weights = _train(tmp_path, strategy, batch_size=8)
    stats = strategy.telemetry_history[-1]
    blocks = DENSE["num_layers"]
    assert stats.fetches == 2 * blocks  # forward and backward, not 2 * blocks * micro_batches
    block_bytes = sum(v.numel() * v.element_size() for k, v in weights.items() if ".blocks." in k)
    assert stats.h2d_bytes == 2 * block_bytes


def test_zero_formulas() -> None:
    assert zero_formula_bytes("none", param_bytes=100, state_bytes_per_param_byte=2, world_size=4) == \
        ModelStateBytes(100, 100, 200)
    assert zero_formula_bytes("zero1", param_bytes=100, state_bytes_per_param_byte=2, world_size=4) == \
        ModelStateBytes(100, 100, 50)
    assert zero_formula_bytes("zero3", param_bytes=100, state_bytes_per_param_byte=2, world_size=4) == \
        ModelStateBytes(25, 25, 50)
    with pytest.raises(ValueError, match="sharding must be one of"):
        zero_formula_bytes("zero9", param_bytes=1, state_bytes_per_param_byte=2, world_size=1)


def test_setup_logs_one_line_with_engine_layout_and_planned_bytes(tmp_path: Path, caplog) -> None:
    import logging
    caplog.set_level(logging.INFO)
    strategy = P2RStrategy(offload_blocks=[0, 2])
    _train(tmp_path, strategy, batch_size=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("P2RStrategy: engine")]
    assert len(lines) == 1
    assert "engine local" in lines[0] and "offloaded blocks [0, 2] of 3" in lines[0] and "no budget" in lines[0]
    assert "MiB per rank" in lines[0] or "KiB per rank" in lines[0]


class _SGDModule(M6LanguageModel):
    """SGD: its update is the gradient itself, so a gradient off by the loss scale shows (Adam would hide it)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fp16_standard_and_layered(tmp_path: Path, module_class: type, scaler_kwargs: dict, max_steps: int
                               ) -> dict[str, tuple[dict, dict, float]]:
    """The same fp16 run with standard accumulation (2 batches of 2) and layered (1 batch of 4, 2 micro-batches):
    per mode the final weights, the initial ones and the GradScaler's final scale."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    results = {}
    for name, strategy, batch_size, accumulate in (("standard", P2RStrategy(), 2, 2),
                                                   ("layered", P2RStrategy(accumulation="layered", micro_batches=2),
                                                    4, 1)):
        L.seed_everything(3)
        module = module_class(M6Config(**DENSE), OptimizerConfig(lr=1e-2, warmup_steps=1, min_lr_ratio=1.0))
        initial = InitialWeights()
        scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
        trainer = tiny_trainer(tmp_path / name, strategy=strategy, max_steps=max_steps, limit_val_batches=0,
                               accumulate_grad_batches=accumulate, callbacks=[initial],
                               plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        trainer.fit(module, datamodule=tiny_data(tmp_path, batch_size=batch_size))
        weights = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
        results[name] = (weights, initial.weights, scaler.get_scale())
    return results


@pytest.mark.parametrize("module_class", [_SGDModule, M6LanguageModel], ids=["sgd", "fused-adamw"])
def test_layered_equals_standard_under_fp16_and_a_gradient_scaler(tmp_path: Path, module_class: type) -> None:
    """With a GradScaler, layered accumulation must hand the optimizer gradients scaled like standard accumulation's
    (it backpropagates each micro-batch's loss itself): the same update, unscaled once (issue 13 item 2)."""
    results = _fp16_standard_and_layered(tmp_path, module_class, {"init_scale": 1024.0}, max_steps=2)
    (standard, start, _), (layered, _, _) = results["standard"], results["layered"]
    assert_trained_alike(layered, standard, start, name="fp16 layered vs standard")


def test_layered_skips_the_same_overflowing_steps_as_standard(tmp_path: Path) -> None:
    """A loss scale too large for fp16 makes the first steps' gradients inf: the scaler must skip those steps and back
    off its scale identically under layered and standard accumulation, then train alike (issue 13 item 2)."""
    results = _fp16_standard_and_layered(tmp_path, _SGDModule, {"init_scale": 2.0**40, "growth_interval": 1000},
                                         max_steps=30)
    (standard, start, standard_scale), (layered, _, layered_scale) = results["standard"], results["layered"]
    assert standard_scale == layered_scale < 2.0**40  # the same steps overflowed and were skipped
    assert any(not torch.equal(standard[k], start[k]) for k in start)  # and the later ones trained
    assert_trained_alike(layered, standard, start, name="fp16 layered vs standard after skipped steps")


@pytest.mark.parametrize("strategy_kwargs", [{"offload_fraction": 1.0}, {"sharding": "zero3"},
                                             {"accumulation": "layered", "micro_batches": 2}])
def test_a_run_prints_none_of_the_known_misleading_warnings(tmp_path: Path, strategy_kwargs: dict) -> None:
    """The notices every run printed and that asked nothing of the user (issue 13 item 13) stay quiet, including on
    a mid-epoch resume; the package's filters are the only ones in force (everything else is shown every time)."""
    import warnings

    misleading = ("overridden after learning rate scheduler", "LeafSpec", "not resumable", "returned a view tensor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", append=True)  # after the package's filters: they still win
        checkpoint = tmp_path / "mid_epoch.ckpt"
        for max_steps, ckpt_path in ((3, None), (4, checkpoint)):
            module = M6LanguageModel(M6Config(**DENSE), OptimizerConfig(lr=1e-2, warmup_steps=1, min_lr_ratio=1.0))
            trainer = tiny_trainer(tmp_path, strategy=P2RStrategy(**strategy_kwargs), max_steps=max_steps,
                                   limit_val_batches=0)
            trainer.fit(module, datamodule=tiny_data(tmp_path, batch_size=4), ckpt_path=ckpt_path)
            if ckpt_path is None:
                assert trainer.global_step < trainer.num_training_batches  # mid-epoch
                trainer.save_checkpoint(checkpoint)
    shown = [str(w.message) for w in caught if any(text in str(w.message) for text in misleading)]
    assert shown == []
