"""delink() and the PseudoToReal callback. A run resumed from a checkpoint (before or after the delink) must continue
bit for bit like the uninterrupted one: one process, the same operations in the same order."""

from pathlib import Path

import lightning as L
import pytest
import torch
from equivalence import assert_bit_identical
from helpers import TINY, tiny_data, tiny_trainer

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, PseudoToReal, delink
from lightning_p2r.callbacks.gradient_agreement import GradientAgreementProbe, mean_pairwise_cosine
from lightning_p2r.callbacks.pseudo_to_real import plan_stages

PSEUDO = TINY | {"num_layers": 4, "num_unique_blocks": 1}


def _module(**changes) -> M6LanguageModel:
    return M6LanguageModel(M6Config(**(PSEUDO | changes)), OptimizerConfig(lr=3e-3, warmup_steps=2))


class Watch(L.Callback):
    """Record, at every batch start, the number of blocks, the optimizer object and the LR."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        optimizer = trainer.optimizers[0]
        self.rows.append((trainer.global_step, len(pl_module.transformer.blocks), id(optimizer),
                          optimizer.param_groups[0]["lr"]))


def _fit(tmp_path: Path, callback: PseudoToReal, max_steps: int = 8, module=None, **trainer_kwargs):
    module = module or _module()
    watch = Watch()
    trainer = tiny_trainer(tmp_path, max_steps=max_steps, callbacks=[callback, watch], val_check_interval=100,
                           **trainer_kwargs)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    return module, trainer, watch


def test_delinks_once_at_the_configured_step(tmp_path: Path) -> None:
    callback = PseudoToReal(delink_at_step=4)
    module, trainer, watch = _fit(tmp_path, callback)
    blocks = {step: n for step, n, _, _ in watch.rows}
    assert blocks == {0: 1, 1: 1, 2: 1, 3: 1, 4: 4, 5: 4, 6: 4, 7: 4}
    assert len(callback.events) == 1
    event = callback.events[0]
    assert (event.step, event.blocks_before, event.blocks_after) == (4, 1, 4)
    assert event.params_after > event.params_before
    assert event.loss_after == pytest.approx(event.loss_before, abs=1e-5)  # function preserved
    optimizers = {step: opt for step, _, opt, _ in watch.rows}
    assert optimizers[3] != optimizers[4] and optimizers[4] == optimizers[7]
    assert trainer.optimizers[0].param_groups[0]["params"][0] is next(module.parameters())
    assert len(module.transformer.blocks) == 4


def test_lr_schedule_continues_through_delinking(tmp_path: Path) -> None:
    _, _, plain = _fit(tmp_path / "plain", PseudoToReal(delink_at_step=7), max_steps=8)
    _, _, delinked = _fit(tmp_path / "delinked", PseudoToReal(delink_at_step=4), max_steps=8)
    assert [row[3] for row in delinked.rows] == pytest.approx([row[3] for row in plain.rows])


def test_restart_schedule_restarts_warmup(tmp_path: Path) -> None:
    _, _, watch = _fit(tmp_path, PseudoToReal(delink_at_step=4, restart_schedule=True))
    lrs = {step: lr for step, _, _, lr in watch.rows}
    assert lrs[4] == pytest.approx(lrs[0])


def test_fraction_and_staged_schedule(tmp_path: Path) -> None:
    callback = PseudoToReal(delink_at_fraction=0.5)
    _fit(tmp_path / "fraction", callback, max_steps=8)
    assert callback.events[0].step == 4
    staged = PseudoToReal(schedule={2: 2, 5: 4})
    _, _, watch = _fit(tmp_path / "staged", staged, max_steps=8)
    assert [n for _, n, _, _ in watch.rows] == [1, 1, 2, 2, 2, 4, 4, 4]
    assert [(e.blocks_before, e.blocks_after) for e in staged.events] == [(1, 2), (2, 4)]


def test_delink_waits_for_the_end_of_an_accumulation_window(tmp_path: Path) -> None:
    callback = PseudoToReal(delink_at_step=3)
    module = _module()
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[callback], accumulate_grad_batches=2,
                           val_check_interval=100)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert callback.events[0].step == 3 and len(module.transformer.blocks) == 4


def test_auto_delinks_on_low_agreement_or_at_the_bound(tmp_path: Path) -> None:
    eager = PseudoToReal(auto=True, auto_threshold=1.0, auto_check_every=1, auto_smoothing=0.0, auto_min_step=2)
    _fit(tmp_path / "eager", eager, max_steps=6)
    assert eager.events[0].step == 2 and "agreement" in eager.events[0].reason
    assert eager.agreement is not None and -1.0 <= eager.agreement <= 1.0
    bounded = PseudoToReal(auto=True, auto_threshold=-1.0, auto_drop_from_peak=None, auto_check_every=2,
                           auto_max_step=5)
    _fit(tmp_path / "bounded", bounded, max_steps=7)
    assert bounded.events[0].step == 5 and "auto_max_step" in bounded.events[0].reason


def test_auto_relative_drop_from_the_peak(tmp_path: Path, monkeypatch) -> None:
    """Feed the callback a made-up agreement series: it fires once the average is 10% under its peak."""
    from lightning_p2r.callbacks import gradient_agreement

    series = iter([0.5, 0.6, 0.7, 0.66, 0.62, 0.6, 0.6, 0.6, 0.6, 0.6])
    def finish(probe):
        probe.remove()
        return next(series)

    monkeypatch.setattr(gradient_agreement.GradientAgreementProbe, "finish", finish)
    callback = PseudoToReal(auto=True, auto_threshold=-1.0, auto_drop_from_peak=0.1, auto_check_every=1,
                            auto_smoothing=0.0)
    _fit(tmp_path, callback, max_steps=8)
    assert callback.peak_agreement == pytest.approx(0.7)
    assert callback.events[0].step == 5 and "peak" in callback.events[0].reason  # 0.62 < 0.9 * 0.7


def test_probe_recovers_each_layers_gradient_of_every_linear_router_and_expert_weight() -> None:
    model = M6LanguageModel(M6Config(**(PSEUDO | {"num_experts": 4, "moe_layers": None, "router_jitter": 0.1})))
    model.configure_model()
    model.train()
    probe = GradientAgreementProbe(model.transformer)
    model.losses(torch.randint(0, 256, (2, 17)))["loss"].backward()
    contributions = dict(probe.contributions)
    agreement = probe.finish()
    assert agreement is not None and -1.0 <= agreement <= 1.0
    block = model.transformer.blocks[0]
    expected = {"blocks.0.attn.qkv.weight", "blocks.0.attn.out.weight", "blocks.0.ffn.router.weight",
                "blocks.0.ffn.experts.w_in", "blocks.0.ffn.experts.w_out"}
    assert set(contributions) == expected
    parameters = dict(block.named_parameters(prefix="blocks.0"))
    for name, calls in contributions.items():
        assert len(calls) == 4, name  # one contribution per layer
        # The per-layer contributions add up to the shared gradient autograd computed (aux and z losses included).
        torch.testing.assert_close(sum(calls), parameters[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    assert not any(handle for handle in probe._handles)  # finish removed every hook


def test_probe_agreement_is_one_when_layers_pull_alike_and_low_when_they_do_not() -> None:
    from lightning_p2r.callbacks.gradient_agreement import expert_weight_gradients

    x = torch.randn(6, 4)
    hidden = x @ torch.randn(2, 4, 8)[0]
    w_out = torch.randn(2, 8, 4)
    grad = torch.randn(6, 4)
    first = expert_weight_gradients(x, hidden, grad, w_out, [6, 0])
    doubled = expert_weight_gradients(x, hidden, 2 * grad, w_out, [6, 0])
    opposite = expert_weight_gradients(x, hidden, -grad, w_out, [6, 0])
    for a, b, c in zip(first, doubled, opposite):
        assert float(mean_pairwise_cosine(torch.stack([a.flatten(), b.flatten()]))) == pytest.approx(1.0)
        assert float(mean_pairwise_cosine(torch.stack([a.flatten(), c.flatten()]))) == pytest.approx(-1.0)
        assert torch.all(a[1] == 0)  # an expert with no rows gets no gradient


def test_mean_pairwise_cosine() -> None:
    same = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    assert float(mean_pairwise_cosine(same)) == pytest.approx(1.0)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert float(mean_pairwise_cosine(opposite)) == pytest.approx(-1.0)


def _weights(module: M6LanguageModel) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


@pytest.mark.parametrize("interrupt_at", [2, 6])
def test_resume_before_and_after_delink_reaches_the_same_weights(tmp_path: Path, interrupt_at: int) -> None:
    L.seed_everything(11)
    straight, _, _ = _fit(tmp_path / "straight", PseudoToReal(delink_at_step=4), max_steps=8)

    L.seed_everything(11)
    checkpoints = tmp_path / "ckpt"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=interrupt_at,
                                                save_top_k=-1, save_on_train_epoch_end=False)
    trainer = tiny_trainer(tmp_path / "first", max_steps=8, val_check_interval=100,
                           callbacks=[PseudoToReal(delink_at_step=4), saver])
    trainer.fit(_module(), datamodule=tiny_data(tmp_path))
    path = next(checkpoints.glob(f"*step={interrupt_at}.ckpt"))
    saved_blocks = torch.load(path, weights_only=True)["lightning_p2r_structure"]["num_unique_blocks"]
    assert saved_blocks == (1 if interrupt_at < 4 else 4)

    resumed_callback = PseudoToReal(delink_at_step=4)
    resumed = _module()  # built pseudo; a post-delink checkpoint makes it real before the weights load
    trainer = tiny_trainer(tmp_path / "second", max_steps=8, val_check_interval=100, callbacks=[resumed_callback])
    trainer.fit(resumed, datamodule=tiny_data(tmp_path), ckpt_path=path, weights_only=True)
    assert len(resumed_callback.events) == 1 and resumed_callback.events[0].step == 4
    expected, got = _weights(straight), _weights(resumed)
    assert_bit_identical(got, expected)


def _checkpoint_at(tmp_path: Path, callback: PseudoToReal, step: int) -> Path:
    """A run of 8 steps under ``callback``, checkpointed at ``step``: that checkpoint."""
    checkpoints = tmp_path / "ckpt"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=step, save_top_k=-1,
                                                save_on_train_epoch_end=False)
    tiny_trainer(tmp_path / "first", max_steps=8, val_check_interval=100,
                 callbacks=[callback, saver]).fit(_module(), datamodule=tiny_data(tmp_path))
    return next(checkpoints.glob(f"*step={step}.ckpt"))


def _resume(tmp_path: Path, path: Path, callback: PseudoToReal) -> M6LanguageModel:
    module = _module()
    tiny_trainer(tmp_path / "second", max_steps=8, val_check_interval=100, callbacks=[callback]).fit(
        module, datamodule=tiny_data(tmp_path), ckpt_path=path, weights_only=True)
    return module


def test_a_resumed_run_does_the_stages_its_model_still_needs(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Resumed into another plan, the stages left were counted by the checkpoint's events (a new-user audit): a
    checkpoint after a staged plan's first stage (2 of 4 blocks), resumed with one delinking to 4 at step 5, never
    delinked; a real checkpoint resumed with a staged plan crashed at its second stage. A stage is done when the
    model has its blocks."""
    staged = _checkpoint_at(tmp_path / "staged", PseudoToReal(schedule={2: 2, 6: 4}), 3)
    callback = PseudoToReal(delink_at_step=5)
    with caplog.at_level("INFO"):
        module = _resume(tmp_path / "staged", staged, callback)
    assert [(event.step, event.blocks_after) for event in callback.events] == [(2, 2), (5, 4)]
    assert len(module.transformer.blocks) == 4
    assert "the checkpoint's model has 2 blocks (delinked at step(s) [2]); of this run's plan [(5, 4)], it still " \
           "does [(5, 4)]" in caplog.text

    real = _checkpoint_at(tmp_path / "real", PseudoToReal(delink_at_step=2), 3)
    callback = PseudoToReal(schedule={1: 2, 5: 4})
    module = _resume(tmp_path / "real", real, callback)  # nothing left: no "already real" at step 5
    assert [(event.step, event.blocks_after) for event in callback.events] == [(2, 4)]
    assert len(module.transformer.blocks) == 4


def test_a_run_resumed_past_its_planned_delinking_says_it_delinks_late(tmp_path: Path) -> None:
    path = _checkpoint_at(tmp_path, PseudoToReal(delink_at_step=6), 3)
    callback = PseudoToReal(delink_at_step=2)
    with pytest.warns(UserWarning, match=r"resumes at step 3, past the delinking planned at step 2: it delinks at "
                                         r"its first step, 3"):
        _resume(tmp_path, path, callback)
    (event,) = callback.events
    assert event.step == 3 and event.reason == "planned at step 2, done at step 3 (resumed past it)"


def test_a_delinking_past_a_run_bounded_by_epochs_is_refused(tmp_path: Path) -> None:
    """The range check read max_steps only: a run of one epoch of 8 batches took a delinking at step 50 and ended
    pseudo, without a word."""
    module = _module()
    steps: list[int] = []
    module.on_train_batch_start = lambda *args: steps.append(1)
    with pytest.raises(ValueError, match=r"delinking at step 50 is outside the run \(8 optimizer steps"):
        _fit(tmp_path, PseudoToReal(delink_at_step=50), max_steps=-1, module=module, max_epochs=1,
             limit_train_batches=8)
    assert steps == []


def test_load_from_checkpoint_after_delink(tmp_path: Path) -> None:
    module, trainer, _ = _fit(tmp_path, PseudoToReal(delink_at_step=2), max_steps=3)
    trainer.save_checkpoint(tmp_path / "real.ckpt")
    loaded = M6LanguageModel.load_from_checkpoint(tmp_path / "real.ckpt", weights_only=True)
    assert len(loaded.transformer.blocks) == 4
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(loaded.eval()(tokens).logits, module.eval()(tokens).logits)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"delink_at_step": 3, "auto": True}, "exactly one"),
        ({"delink_at_fraction": 1.5}, "delink_at_fraction"),
        ({"delink_at_step": 3, "optimizer_state": "halve"}, "optimizer_state"),
        ({"auto": True, "auto_check_every": 0}, "auto_check_every"),
        ({"auto": True, "auto_drop_from_peak": 1.5}, "auto_drop_from_peak"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PseudoToReal(**kwargs)


@pytest.mark.parametrize(
    ("callback", "changes", "message"),
    [
        (PseudoToReal(delink_at_step=50), {}, "outside the run"),
        (PseudoToReal(schedule={2: 3}), {}, "divide"),
        (PseudoToReal(delink_at_step=2), {"num_unique_blocks": 4}, "already real"),
        (PseudoToReal(auto=True), {"num_unique_blocks": 4}, "already real"),
    ],
)
def test_bad_plans_fail_before_the_first_step(tmp_path: Path, callback, changes: dict, message: str) -> None:
    module = _module(**changes)
    steps = []
    module.on_train_batch_start = lambda *args: steps.append(1)
    with pytest.raises(ValueError, match=message):
        _fit(tmp_path, callback, max_steps=8, module=module)
    assert steps == []


def test_unsupported_optimizer_is_refused_at_delinking(tmp_path: Path) -> None:
    class RMSModule(M6LanguageModel):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    with pytest.raises(ValueError, match="RMSprop"):
        _fit(tmp_path, PseudoToReal(delink_at_step=1), max_steps=3, module=RMSModule(M6Config(**PSEUDO)))


def test_plan_stages_is_pure() -> None:
    assert plan_stages(8, 1, 100, None, 0.25, None) == [(25, 8)]
    assert plan_stages(8, 1, 100, None, None, {60: 8, 20: 2}) == [(20, 2), (60, 8)]
    with pytest.raises(ValueError, match="max_steps"):
        plan_stages(8, 1, -1, None, 0.5, None)


@pytest.mark.parametrize("strategy", ["single", "offload", "zero3"])
def test_cycled_sharing_delinks_in_stages_and_resumes_between_them(tmp_path: Path, strategy: str) -> None:
    """sharing="cycle": staged delinking 1 -> 2 -> 4 keeps the layout (layer i runs block i mod U) through the
    callback, a checkpoint taken between the stages (also sharded, also offloaded) and its resume."""
    from lightning_p2r import P2RStrategy

    def make_strategy():
        return {"single": None, "offload": P2RStrategy(offload_fraction=0.5),
                "zero3": P2RStrategy(sharding="zero3")}[strategy]

    def options():
        return {"strategy": make_strategy()} if strategy != "single" else {}

    schedule = {2: 2, 5: 4}
    L.seed_everything(11)
    straight, _, _ = _fit(tmp_path / "straight", PseudoToReal(schedule=schedule), max_steps=7,
                          module=_module(sharing="cycle"), **options())
    assert straight.transformer.layer_to_block == [0, 1, 2, 3]

    L.seed_everything(11)
    checkpoints = tmp_path / "ckpt"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=3, save_top_k=-1,
                                                save_on_train_epoch_end=False)
    module = _module(sharing="cycle")
    watch = Watch()
    trainer = tiny_trainer(tmp_path / "first", max_steps=7, val_check_interval=100,
                           callbacks=[PseudoToReal(schedule=schedule), saver, watch], **options())
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert [blocks for step, blocks, *_ in watch.rows] == [1, 1, 2, 2, 2, 4, 4]
    path = next(checkpoints.glob("*step=3.ckpt"))  # between the stages: 2 blocks

    layout = M6LanguageModel(M6Config(**(PSEUDO | {"sharing": "cycle"})))
    layout.configure_model()
    delink(layout.transformer, num_unique_blocks=2)
    assert layout.transformer.layer_to_block == [0, 1, 0, 1]  # what the resume rebuilds before loading

    resumed_callback = PseudoToReal(schedule=schedule)
    resumed = _module(sharing="cycle")
    trainer = tiny_trainer(tmp_path / "second", max_steps=7, val_check_interval=100, callbacks=[resumed_callback],
                           **options())
    trainer.fit(resumed, datamodule=tiny_data(tmp_path), ckpt_path=path, weights_only=True)
    assert [e.step for e in resumed_callback.events] == [2, 5]
    assert resumed.transformer.layer_to_block == [0, 1, 2, 3]
    assert_bit_identical(_weights(resumed), _weights(straight))


def test_rewarm_ramps_the_learning_rate_after_delinking_and_noise_reaches_every_layout(tmp_path: Path) -> None:
    from torch.distributed.tensor import DTensor

    from lightning_p2r import P2RStrategy
    from lightning_p2r.callbacks.pseudo_to_real import rewarm_scale

    assert [rewarm_scale(k, 4) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    lrs = {}
    for name, kwargs in (("plain", {}), ("rewarm", {"rewarm_steps": 3})):
        _, _, watch = _fit(tmp_path / name, PseudoToReal(delink_at_step=3, **kwargs), max_steps=8)
        lrs[name] = [lr for _, _, _, lr in watch.rows]
    for step in range(8):
        scale = rewarm_scale(step - 3, 3) if 3 <= step < 6 else 1.0
        assert lrs["rewarm"][step] == pytest.approx(lrs["plain"][step] * scale), step

    weights = {}
    for name, strategy in (("single", None), ("offload", P2RStrategy(offload_fraction=0.5)),
                           ("zero3", P2RStrategy(sharding="zero3"))):
        L.seed_everything(5)
        options = {"strategy": strategy} if strategy is not None else {}
        module, _, _ = _fit(tmp_path / f"noise_{name}", PseudoToReal(delink_at_step=2, delink_noise=0.01),
                            max_steps=3, **options)
        weights[name] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                         for k, v in module.state_dict().items()}
    assert_bit_identical(weights["offload"], weights["single"])  # the same noise on every placement
    assert_bit_identical(weights["zero3"], weights["single"])
    with pytest.raises(ValueError, match="delink_noise"):
        PseudoToReal(delink_at_step=1, delink_noise=2.0)
    with pytest.raises(ValueError, match="rewarm_steps"):
        PseudoToReal(delink_at_step=1, rewarm_steps=-1)
