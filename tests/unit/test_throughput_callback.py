"""The Throughput callback: tokens counted per batch, FLOPs per device under layouts that split the model, and the
figures a real run logs (a relation between them, not a speed: no timing is asserted)."""

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import TINY, tiny_data

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy, Throughput
from lightning_p2r.callbacks.throughput import forward_flops_per_token, tokens_in
from lightning_p2r.planning.model import model_forward_flops


def test_tokens_in_counts_language_model_batches() -> None:
    assert tokens_in(torch.zeros(4, 33, dtype=torch.long)) == 4 * 32  # a window's last position is only a target
    assert tokens_in({"input_ids": torch.zeros(2, 16)}) == 32
    assert tokens_in((torch.zeros(3, 9), "meta")) == 24
    with pytest.raises(ValueError, match="tokens_fn"):
        tokens_in("text")


def test_an_m6_module_counts_its_active_flops_and_a_foreign_one_its_matrices() -> None:
    module = M6LanguageModel(M6Config(**TINY))
    module.configure_model()
    assert forward_flops_per_token(module, 16) == model_forward_flops(module.config, 16)
    foreign = L.LightningModule()
    foreign.embed = torch.nn.Embedding(10, 4)
    foreign.proj = torch.nn.Linear(4, 6, bias=True)
    assert forward_flops_per_token(foreign, 8) == 2 * 24


def _stub(world_size: int, strategy) -> tuple[SimpleNamespace, SimpleNamespace]:
    trainer = SimpleNamespace(world_size=world_size, strategy=SimpleNamespace(
        root_device=torch.device("cpu"), layout=getattr(strategy, "layout", None)), precision="32-true")
    logged = {}
    module = SimpleNamespace(forward_flops_per_token=lambda seq_len: 1e9,
                             log=lambda name, value, **kwargs: logged.__setitem__(name, value))
    return trainer, module, logged


@pytest.mark.parametrize(("options", "world", "data_parallel"), [
    ({}, 2, 2), ({"tensor_parallel": 2}, 2, 1), ({"pipeline_parallel": 2, "micro_batches": 4}, 4, 2),
    ({"expert_parallel": 2}, 2, 2)])
def test_flops_per_device_count_the_global_work_once(options: dict, world: int, data_parallel: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, module, logged = _stub(world, P2RStrategy(**options))
    callback = Throughput(window=2, peak_tflops=100.0, prog_bar=False)
    clock = iter([10.0, 12.0])
    monkeypatch.setattr("lightning_p2r.callbacks.throughput.time.perf_counter", lambda: next(clock))
    batch = torch.zeros(4, 129, dtype=torch.long)  # 512 tokens on this rank
    callback.on_train_batch_start(trainer, module, batch, 0)
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    callback.on_train_batch_end(trainer, module, None, batch, 1)
    seconds, local_tokens = 2.0, 2 * 512
    assert logged["perf/tokens_per_s"] == pytest.approx(local_tokens * data_parallel / seconds)
    expected = 3 * 1e9 * local_tokens * data_parallel / world / seconds / 1e12
    assert logged["perf/tflops_per_device"] == pytest.approx(expected)
    assert logged["perf/mfu"] == pytest.approx(expected / 100.0)


def test_a_run_logs_throughput_figures_that_agree_with_each_other(tmp_path: Path) -> None:
    L.seed_everything(0)
    module = M6LanguageModel(M6Config(**TINY), OptimizerConfig(warmup_steps=1))
    callback = Throughput(window=2, peak_tflops=0.5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, default_root_dir=tmp_path,
                        callbacks=[callback], enable_model_summary=False)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    figures = callback.last
    assert set(figures) == {"perf/tokens_per_s", "perf/tflops_per_device", "perf/mfu"}
    assert figures["perf/tokens_per_s"] > 0
    flops_per_token = 3 * model_forward_flops(module.config, TINY["max_seq_len"])
    assert figures["perf/tflops_per_device"] == pytest.approx(figures["perf/tokens_per_s"] * flops_per_token / 1e12)
    assert figures["perf/mfu"] == pytest.approx(figures["perf/tflops_per_device"] / 0.5)
    assert trainer.callback_metrics["perf/mfu"] == pytest.approx(figures["perf/mfu"])


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        Throughput(window=0)


def test_a_validation_run_inside_a_window_is_left_out_of_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, module, logged = _stub(1, P2RStrategy())
    callback = Throughput(window=2, prog_bar=False)
    clock = iter([0.0, 1.0, 9.0, 10.0])  # batch 0 from 0 to 1 s, validation 1 to 9 s, batch 1 from 9 to 10 s
    monkeypatch.setattr("lightning_p2r.callbacks.throughput.time.perf_counter", lambda: next(clock))
    batch = torch.zeros(2, 9, dtype=torch.long)
    callback.on_train_batch_start(trainer, module, batch, 0)
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    callback.on_validation_start(trainer, module)
    callback.on_train_batch_start(trainer, module, batch, 1)
    callback.on_train_batch_end(trainer, module, None, batch, 1)
    assert logged["perf/tokens_per_s"] == pytest.approx(2 * 16 / 2.0)


def test_the_flops_are_counted_again_each_window_so_a_delinked_or_grown_model_is_priced_as_it_is_now(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, module, logged = _stub(1, P2RStrategy())
    flops = iter([1e9, 4e9])
    module.forward_flops_per_token = lambda seq_len: next(flops)
    callback = Throughput(window=1, prog_bar=False)
    clock = iter([0.0, 1.0, 1.0, 2.0])
    monkeypatch.setattr("lightning_p2r.callbacks.throughput.time.perf_counter", lambda: next(clock))
    batch = torch.zeros(1, 2, dtype=torch.long)
    seen = []
    for index in range(2):
        callback.on_train_batch_start(trainer, module, batch, index)
        callback.on_train_batch_end(trainer, module, None, batch, index)
        seen.append(logged["perf/tflops_per_device"])
    assert seen[1] == pytest.approx(4 * seen[0])


def test_a_shallow_pseudo_model_is_priced_at_the_depth_it_runs() -> None:
    deep = M6Config(**(TINY | {"num_layers": 4}))
    shallow = M6Config(**(TINY | {"num_layers": 4, "num_unique_blocks": 2, "sharing": "cycle",
                                  "pseudo_depth": "shallow"}))
    assert shallow.run_depth == 2
    assert model_forward_flops(shallow, 16) == model_forward_flops(M6Config(**(TINY | {"num_layers": 2})), 16)
    assert model_forward_flops(shallow, 16) < model_forward_flops(deep, 16)


def test_the_generic_count_follows_shared_layers_a_tied_head_and_routed_experts() -> None:
    class Decoder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(num_experts_per_tok=2, num_local_experts=8)
            self.embed = torch.nn.Embedding(10, 4)
            block = torch.nn.Linear(4, 4, bias=False)
            self.layers = torch.nn.ModuleList([block, block, block])  # one block run by three layers
            self.experts = torch.nn.Module()
            self.experts.gate_up = torch.nn.Parameter(torch.zeros(8, 4, 6))  # stacked: 8 experts of 4 x 6
            self.router = torch.nn.Linear(4, 8, bias=False)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied: the lookup is free, the head's matmul is not

    expected = 3 * 16 + 8 * 24 * (2 / 8) + 32 + 40
    assert forward_flops_per_token(Decoder(), 8) == 2 * expected
