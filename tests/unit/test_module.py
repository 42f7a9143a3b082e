"""M6LanguageModel through the Trainer. Checkpoint round trips and resumed runs are compared bit for bit: one process,
the same kernels in the same order as the run that never stopped (tests/unit/equivalence.py says when a comparison
may not be exact)."""

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from equivalence import assert_bit_identical
from helpers import TINY
from helpers import tiny_data as _data
from helpers import tiny_trainer as _trainer

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig
from lightning_p2r.module import WarmupCosine, WarmupStableDecay, lr_multiplier, parameter_groups


def test_warmup_cosine_schedule() -> None:
    schedule = WarmupCosine(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(59.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(109) == pytest.approx(0.1)  # the last of 110 steps trains at the minimum
    assert schedule(108) > 0.1
    assert schedule(500) == pytest.approx(0.1)
    assert WarmupCosine(0, 10, 0.0)(0) == pytest.approx(1.0)


def test_warmup_stable_decay_schedule() -> None:
    schedule = WarmupStableDecay(warmup_steps=10, total_steps=110, min_lr_ratio=0.0, decay_fraction=0.2)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(50) == schedule(87) == 1.0  # stable until the last 22 steps
    assert schedule(98) == pytest.approx(1.0 - 11 / 22)
    assert schedule(109) == 0.0  # the last step is fully decayed
    assert all(schedule(s) > schedule(s + 1) for s in range(87, 109))
    # A decay longer than the run after warmup starts right after warmup.
    assert WarmupStableDecay(10, 20, 0.0, 1.0).decay_start == 10
    assert isinstance(lr_multiplier(OptimizerConfig(schedule="wsd"), 100), WarmupStableDecay)
    assert isinstance(lr_multiplier(OptimizerConfig(), 100), WarmupCosine)
    with pytest.raises(ValueError, match="schedule must be 'cosine' or 'wsd'"):
        OptimizerConfig(schedule="linear")
    with pytest.raises(ValueError, match="decay_fraction"):
        OptimizerConfig(schedule="wsd", decay_fraction=0.0)


def test_parameter_groups_list_each_tensor_once() -> None:
    module = M6LanguageModel(M6Config(**TINY, tie_embeddings=True))
    module.configure_model()
    groups = parameter_groups(module, weight_decay=0.1)
    ids = [id(p) for group in groups for p in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(module.parameters()))
    assert all(p.dim() < 2 for p in groups[1]["params"])


def test_fit_logs_metrics_and_the_loss_falls(tmp_path: Path) -> None:
    model = M6LanguageModel(M6Config(**TINY), OptimizerConfig(lr=3e-3, warmup_steps=2))
    trainer = _trainer(tmp_path, max_steps=30, val_check_interval=10)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(model, datamodule=_data(tmp_path))
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/aux_loss", "train/z_loss", "val/loss", "val/ppl", "lr",
                "train/tokens_per_sec", "moe/load_max_over_mean", "moe/dropped_fraction",
                "moe/layer1/load_max_over_mean"):
        assert key in metrics, key
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(metrics["val/loss"])), rel=1e-3)
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]
    assert isinstance(trainer.optimizers[0], torch.optim.AdamW)


class StepLogs(L.pytorch.loggers.Logger):
    """The metric names each logger write received, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[int, set[str]] = {}

    name, version = "steps", 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.written.setdefault(step, set()).update(metrics)


@pytest.mark.parametrize("layout", ["standard", "layered"])
def test_secondary_metrics_reach_every_logger_write_and_are_not_logged_between(tmp_path: Path, layout: str) -> None:
    """The per-layer routing metrics, the total, auxiliary and z losses and the learning rate are logged only on the
    steps Lightning writes (``log_every_n_steps``), with micro-batches accumulated by Lightning or by the layered
    executor: every write that has the loss has them. The loss, on the progress bar, is logged on every batch."""
    from lightning_p2r import P2RStrategy

    model = M6LanguageModel(M6Config(**TINY), OptimizerConfig(warmup_steps=1))
    logs = StepLogs()
    options = ({"accumulate_grad_batches": 2} if layout == "standard"
               else {"strategy": P2RStrategy(accumulation="layered", micro_batches=2)})
    trainer = _trainer(tmp_path, max_steps=7, log_every_n_steps=3, logger=logs, limit_val_batches=0, **options)
    logged: list[str] = []
    log = model.log
    model.log = lambda name, *args, **kwargs: (logged.append(name), log(name, *args, **kwargs))[1]
    trainer.fit(model, datamodule=_data(tmp_path))
    writes = {step: names for step, names in logs.written.items() if "train/loss" in names}
    assert sorted(writes) == [2, 5]  # Lightning's 0-based steps of the 3rd and 6th optimizer steps
    for names in writes.values():
        assert {"moe/load_max_over_mean", "moe/dropped_fraction", "moe/layer1/load_max_over_mean",
                "train/total_loss", "train/aux_loss", "train/z_loss", "lr", "train/tokens_per_sec"} <= names
    # Logged on those two steps only (per micro-batch of standard accumulation, once per step when layered).
    per_step = 2 if layout == "standard" else 1
    for name in ("moe/layer1/dropped_fraction", "train/total_loss", "train/aux_loss", "train/z_loss"):
        assert logged.count(name) == 2 * per_step, name
    assert logged.count("train/loss") == 7 * per_step
    # The learning rate is read after a batch: at the end of the written steps (and, harmlessly, on the first
    # micro-batch after them, before the step counter moves), never on most batches.
    assert 2 <= logged.count("lr") <= 2 + 2 * (per_step - 1) + 1


def test_checkpoint_round_trip_with_weights_only(tmp_path: Path) -> None:
    model = M6LanguageModel(M6Config(**TINY, num_unique_blocks=1))
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(model, datamodule=_data(tmp_path))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    raw = torch.load(path, weights_only=True)  # no pickled classes inside
    assert raw["hyper_parameters"]["config"]["num_unique_blocks"] == 1
    loaded = M6LanguageModel.load_from_checkpoint(path, weights_only=True)
    assert loaded.config == model.config
    assert_bit_identical(loaded.state_dict(), model.state_dict())


def test_resume_continues_to_the_same_weights(tmp_path: Path) -> None:
    L.seed_everything(7)
    straight = M6LanguageModel(M6Config(**TINY))
    _trainer(tmp_path / "a", max_steps=6, val_check_interval=100).fit(straight, datamodule=_data(tmp_path))

    L.seed_everything(7)
    first = M6LanguageModel(M6Config(**TINY))
    trainer = _trainer(tmp_path / "b", max_steps=3, val_check_interval=100)
    trainer.fit(first, datamodule=_data(tmp_path))
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = M6LanguageModel(M6Config(**TINY))
    _trainer(tmp_path / "b", max_steps=6, val_check_interval=100).fit(
        resumed, datamodule=_data(tmp_path), ckpt_path=tmp_path / "mid.ckpt", weights_only=True)
    assert_bit_identical(resumed.state_dict(), straight.state_dict())


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_a_resumed_run_longer_than_its_schedule_is_refused_at_rate_zero_and_warned_about_above(
        tmp_path: Path, min_lr_ratio: float) -> None:
    """The schedule's length comes back with the checkpoint: resumed with a larger max_steps, the added steps train
    at its last rate. At min_lr_ratio 0 they trained nothing, silently (a new-user audit: val/loss at step 59 equal to
    step 49's in every digit); now refused before the first step. Above 0, said."""
    optimizer = OptimizerConfig(warmup_steps=1, min_lr_ratio=min_lr_ratio)
    first = M6LanguageModel(M6Config(**TINY), optimizer)
    # A schedule of 3 steps, saved after 2: every resume below has a step left to train (a run resumed at its end
    # would skip the fit loop, and with it the check).
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1,
                                                save_on_train_epoch_end=False)
    _trainer(tmp_path / "a", max_steps=3, val_check_interval=100, callbacks=[saver]).fit(
        first, datamodule=_data(tmp_path))
    (tmp_path / "ckpt" / "epoch=0-step=2.ckpt").rename(tmp_path / "end.ckpt")
    resumed = M6LanguageModel(M6Config(**TINY), optimizer)
    steps: list[int] = []
    resumed.on_train_batch_start = lambda *args: steps.append(1)
    longer = _trainer(tmp_path / "b", max_steps=5, val_check_interval=100)
    message = r"goes to step 5 .*spans the checkpoint's 3 steps: steps 3 to 4 would train at the schedule's last rate"
    if min_lr_ratio == 0:
        with pytest.raises(ValueError, match=message + r".*learning rate 0, training nothing.*--trainer.max_steps=3"):
            longer.fit(resumed, datamodule=_data(tmp_path), ckpt_path=tmp_path / "end.ckpt", weights_only=True)
        assert steps == []
    else:
        with pytest.warns(UserWarning, match=message + r", min_lr_ratio=0.1 times the peak"):
            longer.fit(resumed, datamodule=_data(tmp_path), ckpt_path=tmp_path / "end.ckpt", weights_only=True)
        assert longer.global_step == 5
    straight = _trainer(tmp_path / "c", max_steps=3, val_check_interval=100)  # as long as its schedule: no word
    again = M6LanguageModel(M6Config(**TINY), optimizer)
    again_steps: list[int] = []
    again.on_train_batch_start = lambda *args: again_steps.append(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        straight.fit(again, datamodule=_data(tmp_path), ckpt_path=tmp_path / "end.ckpt", weights_only=True)
    assert not [w for w in caught if "schedule" in str(w.message)]
    assert again_steps == [1] and straight.global_step == 3  # it trained its last step: the check ran


def test_predict_returns_next_token_ids(tmp_path: Path) -> None:
    model = M6LanguageModel(M6Config(**TINY))
    predictions = _trainer(tmp_path, limit_predict_batches=1).predict(model, datamodule=_data(tmp_path))
    assert predictions[0].shape == (4, 16) and predictions[0].dtype == torch.long


def test_bad_batch_shape_is_rejected() -> None:
    model = M6LanguageModel(M6Config(**TINY))
    with pytest.raises(ValueError, match="batch, seq"):
        model.losses(torch.zeros(4, dtype=torch.long))


def test_hparams_accept_plain_dicts() -> None:
    model = M6LanguageModel(config={"num_layers": 2, "num_experts": 2}, optimizer={"lr": 1e-3})
    assert model.config.num_layers == 2 and model.optimizer_config.lr == 1e-3
    with pytest.raises(TypeError, match="M6Config"):
        M6LanguageModel(config=3)


def test_bf16_mixed_with_clipping_trains(tmp_path: Path) -> None:
    """Autocast runs the experts in bf16 (the combine must cast back) and clipping needs the non-fused kernel."""
    model = M6LanguageModel(M6Config(**TINY))
    trainer = _trainer(tmp_path, max_steps=2, precision="bf16-mixed", gradient_clip_val=1.0)
    trainer.fit(model, datamodule=_data(tmp_path))
    assert trainer.optimizers[0].defaults.get("fused") is False
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_unbounded_run_has_no_cosine_to_follow(tmp_path: Path) -> None:
    model = M6LanguageModel(M6Config(**TINY))
    trainer = _trainer(tmp_path, max_steps=-1, max_epochs=-1)
    with pytest.raises(ValueError, match="finite run"):
        trainer.fit(model, datamodule=_data(tmp_path))


def test_resume_after_a_max_steps_stop_across_an_epoch_boundary(tmp_path: Path) -> None:
    from helpers import tiny_data

    data = lambda: tiny_data(tmp_path, batch_size=64)  # noqa: E731  (about 10 batches per epoch)
    L.seed_everything(7)
    straight = M6LanguageModel(M6Config(**TINY))
    _trainer(tmp_path / "a", max_steps=14, val_check_interval=None, check_val_every_n_epoch=100).fit(
        straight, datamodule=data())
    L.seed_everything(7)
    first = M6LanguageModel(M6Config(**TINY))
    trainer = _trainer(tmp_path / "b", max_steps=3, val_check_interval=None, check_val_every_n_epoch=100)
    trainer.fit(first, datamodule=data())
    trainer.save_checkpoint(tmp_path / "stopped.ckpt")
    resumed = M6LanguageModel(M6Config(**TINY))
    trainer = _trainer(tmp_path / "b", max_steps=14, val_check_interval=None, check_val_every_n_epoch=100)
    trainer.fit(resumed, datamodule=data(), ckpt_path=tmp_path / "stopped.ckpt", weights_only=True)
    assert trainer.current_epoch >= 1
    assert_bit_identical(resumed.state_dict(), straight.state_dict())


def test_zero_learning_rate_is_accepted_and_moves_nothing(tmp_path) -> None:
    module = M6LanguageModel(M6Config(**TINY), OptimizerConfig(lr=0.0, weight_decay=0.0, warmup_steps=1))
    module.configure_model()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    _trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module, datamodule=_data(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_vocabulary_larger_than_the_model_is_refused_before_training(tmp_path) -> None:
    module = M6LanguageModel(M6Config(**(TINY | {"vocab_size": 128})))  # the byte tokenizer has 256 ids
    steps = []
    module.on_train_batch_start = lambda *args: steps.append(1)
    with pytest.raises(ValueError, match=r"256 ids but M6Config.vocab_size is 128"):
        _trainer(tmp_path, max_steps=1).fit(module, datamodule=_data(tmp_path))
    assert steps == []


class _NanAtStep(M6LanguageModel):
    """The logits of the batch at optimizer step 2 are NaN (as after an overflow), on the standard and the layered
    path alike (both run the final norm)."""

    def poisons(self, batch_idx: int) -> bool:
        return self.trainer.global_step == 2

    def on_train_batch_start(self, batch, batch_idx):
        if self.poisons(batch_idx):
            self._nan = self.transformer.norm.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        if getattr(self, "_nan", None) is not None:
            self._nan.remove()
            self._nan = None


@pytest.mark.parametrize("layered", [False, True], ids=["standard", "layered"])
def test_a_non_finite_loss_stops_naming_the_step_or_is_skipped(tmp_path: Path, layered: bool) -> None:
    from lightning_p2r import P2RStrategy

    def strategy():
        return P2RStrategy(accumulation="layered", micro_batches=2) if layered else P2RStrategy()

    config = M6Config(**(TINY | {"moe_layers": []}))
    module = _NanAtStep(config, OptimizerConfig(warmup_steps=1))
    trainer = _trainer(tmp_path / "stop", strategy=strategy(), max_steps=4, limit_val_batches=0)
    with pytest.raises(FloatingPointError, match=r"training loss is nan at step 2: stopping.*nonfinite_loss=skip"):
        trainer.fit(module, datamodule=_data(tmp_path))
    assert trainer.global_step == 2

    module = _NanAtStep(config, OptimizerConfig(warmup_steps=1, nonfinite_loss="skip"))
    trainer = _trainer(tmp_path / "skip", strategy=strategy(), max_steps=4, limit_val_batches=0)
    with pytest.warns(UserWarning, match="non-finite training loss .* at step 2: its update is skipped"):
        trainer.fit(module, datamodule=_data(tmp_path))
    assert trainer.global_step == 4
    assert all(torch.isfinite(p).all() for p in module.parameters())


class _NanInFirstMicroBatch(_NanAtStep):
    """The loss of the first of the two micro-batches of optimizer step 2 is NaN; the second's is finite. Counts the
    ranks' finiteness decisions."""

    decisions = 0

    def poisons(self, batch_idx: int) -> bool:
        return self.trainer.global_step == 2 and batch_idx % 2 == 0

    def loss_is_usable(self, loss):
        self.decisions += 1
        return super().loss_is_usable(loss)


@pytest.mark.parametrize("options", [None, {}, {"offload_fraction": 1.0}, {"sharding": "zero2"}],
                         ids=["lightning", "p2r", "offloaded", "zero2"])
def test_standard_accumulation_decides_on_non_finite_losses_once_per_step(tmp_path: Path, options) -> None:
    """Two micro-batches per step: the ranks agree on the losses once per step, and a NaN in the step's first
    micro-batch stops the run before that step's update, naming it, or skips the whole step: its gradients are
    forgotten wherever the strategy holds them (the host for offloaded blocks; FSDP2's units)."""
    from lightning_p2r import P2RStrategy

    def strategy():
        return "auto" if options is None else P2RStrategy(**options)

    config = M6Config(**(TINY | {"moe_layers": []}))
    module = _NanInFirstMicroBatch(config, OptimizerConfig(warmup_steps=1))
    trainer = _trainer(tmp_path / "stop", strategy=strategy(), max_steps=4, limit_val_batches=0,
                       accumulate_grad_batches=2)
    with pytest.raises(FloatingPointError, match=r"training loss is nan at step 2: stopping"):
        trainer.fit(module, datamodule=_data(tmp_path))
    assert trainer.global_step == 2
    assert module.decisions == 3  # steps 0, 1 and 2: one decision each, at the step's second micro-batch

    module = _NanInFirstMicroBatch(config, OptimizerConfig(warmup_steps=1, nonfinite_loss="skip"))
    trainer = _trainer(tmp_path / "skip", strategy=strategy(), max_steps=4, limit_val_batches=0,
                       accumulate_grad_batches=2)
    before_step_2: dict[str, torch.Tensor] = {}

    class Snapshot(L.Callback):
        """The weights when step 2's first micro-batch starts, and whether they were the same after its last."""

        unchanged: bool | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and batch_idx % 2 == 0:
                before_step_2.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if before_step_2 and self.unchanged is None and batch_idx % 2 == 1:
                self.unchanged = all(torch.equal(before_step_2[k], v) for k, v in pl_module.state_dict().items())

    snapshot = Snapshot()
    trainer.callbacks.append(snapshot)
    with pytest.warns(UserWarning, match="non-finite training loss \\(nan\\) at step 2: its update is skipped"):
        trainer.fit(module, datamodule=_data(tmp_path))
    assert trainer.global_step == 4
    assert module.decisions == 4  # one per step; Lightning counts the skipped step 2 as a step
    assert snapshot.unchanged  # the skipped step left the weights alone
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_a_checkpoint_from_before_the_head_major_qkv_layout_is_refused() -> None:
    """Its weights would load without error and the attention would read other heads' q, k and v."""
    module = M6LanguageModel(M6Config(**TINY))
    module.configure_model()
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    M6LanguageModel(M6Config(**TINY)).on_load_checkpoint(checkpoint)  # today's layout loads
    del checkpoint["lightning_p2r_structure"]["qkv_layout"]
    with pytest.raises(ValueError, match="before the attention's qkv rows became head-major"):
        M6LanguageModel(M6Config(**TINY)).on_load_checkpoint(checkpoint)


@pytest.mark.parametrize(("changes", "structure", "held"), [
    ({"num_unique_blocks": 2}, {"num_unique_blocks": 2, "experts_shared": False}, {"num_unique_blocks": 2}),
    ({"num_unique_blocks": 1}, {"num_unique_blocks": 4, "experts_shared": False}, {"num_unique_blocks": None}),
    ({"num_unique_blocks": 1}, {"num_unique_blocks": 2, "experts_shared": False}, {"num_unique_blocks": 2}),
    ({"num_unique_blocks": 2, "pseudo_depth": "shallow", "sharing": "cycle", "growth_init": "zero_outputs"},
     {"num_unique_blocks": 4, "experts_shared": False},
     {"num_unique_blocks": None, "pseudo_depth": "shared", "growth_init": "copy"}),
    ({"num_unique_experts": 1}, {"num_unique_blocks": 4, "experts_shared": True}, {"num_unique_experts": 1}),
    ({"num_unique_experts": 1}, {"num_unique_blocks": 4, "experts_shared": False}, {"num_unique_experts": None}),
    ({"num_unique_blocks": 2}, None, {"num_unique_blocks": 2}),
], ids=["pseudo", "delinked", "staged", "grown", "shared experts", "upcycled", "no record"])
def test_the_config_of_a_checkpoint_describes_the_model_its_tensors_hold(changes, structure, held) -> None:
    """`convert --to safetensors` wrote the hyperparameters as the module was created: a delinked, grown or
    upcycled model's config.json described the pseudo model, whose shapes its tensors do not have."""
    from lightning_p2r.module import config_as_held

    config = M6Config(**{**TINY, "num_layers": 4, **changes}).to_dict()
    result = config_as_held(config, structure)
    assert result == {**config, **held}
    M6Config(**result)  # a valid config
