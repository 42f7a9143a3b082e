"""The "per_layer" optimizer-state policy: each copy's second moment from its own layers' gradients."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from equivalence import assert_bit_identical
from helpers import TINY, tiny_data, tiny_trainer

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, PseudoToReal, delink
from lightning_p2r.callbacks.per_layer_moments import SecondMomentTracker
from lightning_p2r.sharing import MeasuredSecondMoments, new_layout

MOE = TINY | {"num_layers": 4, "num_unique_blocks": 1, "num_experts": 4, "moe_layers": None, "router_jitter": 0.0}


@pytest.mark.parametrize(("sharing", "target"), [("sequence", None), ("cycle", 2), ("sequence", 2)])
def test_tracker_rebuilds_each_future_copys_gradient(sharing: str, target: int | None) -> None:
    """What the tracker folds for copy j equals the gradient the delinked model's block j gets on the same batch."""
    pseudo = M6LanguageModel(M6Config(**(MOE | {"sharing": sharing})))
    pseudo.configure_model()
    real = copy.deepcopy(pseudo)
    delink(real, num_unique_blocks=target)
    holder = pseudo.transformer
    new_map, _ = new_layout(holder.layer_to_block, target or 4, sharing)
    assert new_map == real.transformer.layer_to_block
    tracker = SecondMomentTracker(holder, new_map)
    batch = torch.randint(0, 256, (2, 17))
    for model in (pseudo, real):
        model.train()
        model.losses(batch)["loss"].backward()
    tracker.fold()
    assert tracker.steps == 1
    assert "run_layer" in vars(holder)  # wrapped while attached
    moments = tracker.finish()
    assert "run_layer" not in vars(holder)  # the class's method again
    shared = dict(pseudo.transformer.named_parameters())
    names = {"attn.qkv.weight", "attn.out.weight", "ffn.router.weight", "ffn.experts.w_in", "ffn.experts.w_out"}
    for block_index, block in enumerate(real.transformer.blocks):
        for name in names:
            own = block.get_parameter(name).grad
            torch.testing.assert_close(tracker.copy_squares[f"blocks.{block_index}.{name}"], own.square(),
                                       atol=1e-9, rtol=1e-4, msg=name)
            shared_squares = tracker.shared_squares[f"blocks.0.{name}"]
            torch.testing.assert_close(shared_squares, shared[f"blocks.0.{name}"].grad.square(), atol=1e-9,
                                       rtol=1e-4, msg=name)
            ratio = moments.ratios[f"blocks.{block_index}.{name}"]
            mask = shared_squares > 0
            torch.testing.assert_close(ratio[mask] * shared_squares[mask], own.square()[mask], atol=1e-9,
                                       rtol=1e-4, msg=name)
            assert torch.all(ratio[~mask] == 1 / (len(real.transformer.blocks)) ** 2)


def test_delink_carries_measured_second_moments_and_scales_the_rest() -> None:
    model = M6LanguageModel(M6Config(**(MOE | {"moe_layers": []})))
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.losses(torch.randint(0, 256, (2, 17)))["loss"].backward()
    optimizer.step()
    qkv = model.transformer.blocks[0].attn.qkv.weight
    norm = model.transformer.blocks[0].attn_norm.weight
    ratios = {f"blocks.{j}.attn.qkv.weight": torch.full_like(qkv, 0.1 * (j + 1)) for j in range(4)}
    before = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in (qkv, norm)}
    new = delink(model, optimizer, optimizer_state=MeasuredSecondMoments(ratios, steps=1))
    for j, block in enumerate(model.transformer.blocks):
        state = new.state[block.attn.qkv.weight]
        torch.testing.assert_close(state["exp_avg_sq"], before[qkv]["exp_avg_sq"] * 0.1 * (j + 1))
        torch.testing.assert_close(state["exp_avg"], before[qkv]["exp_avg"] / 4)  # first moments: "scale"
        norm_state = new.state[block.attn_norm.weight]  # not measured: "scale"
        torch.testing.assert_close(norm_state["exp_avg_sq"], before[norm]["exp_avg_sq"] / 16)


def _fit(root: Path, callback: PseudoToReal, max_steps: int, **trainer_kwargs) -> M6LanguageModel:
    module = M6LanguageModel(M6Config(**MOE), OptimizerConfig(lr=3e-3, warmup_steps=2))
    trainer = tiny_trainer(root, max_steps=max_steps, callbacks=[callback], val_check_interval=100, **trainer_kwargs)
    trainer.fit(module, datamodule=tiny_data(root))
    return module, trainer


def test_per_layer_policy_through_the_callback_is_the_same_on_every_placement(tmp_path: Path) -> None:
    """Measured for 2 steps before the delink at step 3; single device, offloaded and 1-process ZeRO-3 agree to the
    bit, and the copies' second moments differ (scale would give every copy the same)."""
    from torch.distributed.tensor import DTensor

    from lightning_p2r import P2RStrategy

    weights, moments = {}, {}
    for name, strategy in (("single", None), ("offload", P2RStrategy(offload_fraction=0.5)),
                           ("zero3", P2RStrategy(sharding="zero3"))):
        L.seed_everything(5)
        options = {"strategy": strategy} if strategy is not None else {}
        callback = PseudoToReal(delink_at_step=3, optimizer_state="per_layer", per_layer_steps=2)
        module, trainer = _fit(tmp_path / name, callback, max_steps=4, **options)
        assert callback._tracker is None and len(module.transformer.blocks) == 4
        weights[name] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                         for k, v in module.state_dict().items()}
        if name == "single":
            optimizer = trainer.optimizers[0]
            moments = [optimizer.state[b.attn.qkv.weight]["exp_avg_sq"].mean() for b in module.transformer.blocks]
    assert_bit_identical(weights["offload"], weights["single"])
    assert_bit_identical(weights["zero3"], weights["single"])
    assert len({round(float(m), 12) for m in moments}) == 4


def test_per_layer_bad_arguments_and_fallback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_layer.*auto"):
        PseudoToReal(auto=True, optimizer_state="per_layer")
    with pytest.raises(ValueError, match="per_layer_steps"):
        PseudoToReal(delink_at_step=2, optimizer_state="per_layer", per_layer_steps=0)
    with pytest.raises(ValueError, match="optimizer_state must be one of"):
        PseudoToReal(delink_at_step=2, optimizer_state="per-layer")
    # A run that fails inside the measuring window unhooks the model.
    class FailAtStep3(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                assert "run_layer" in vars(pl_module.transformer)  # measuring
                raise RuntimeError("stop here")

    callback = PseudoToReal(delink_at_step=5, optimizer_state="per_layer", per_layer_steps=3)
    module = M6LanguageModel(M6Config(**MOE), OptimizerConfig(lr=3e-3, warmup_steps=2))
    trainer = tiny_trainer(tmp_path / "fails", max_steps=6, callbacks=[callback, FailAtStep3()], val_check_interval=100)
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.fit(module, datamodule=tiny_data(tmp_path / "fails"))
    assert callback._tracker is None and "run_layer" not in vars(module.transformer)
    # Delinking at step 0 leaves nothing to measure: a warning, and "scale".
    with pytest.warns(UserWarning, match="no step was measured"):
        _fit(tmp_path, PseudoToReal(delink_at_step=0, optimizer_state="per_layer"), max_steps=1)
