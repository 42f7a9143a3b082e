"""An error raised inside a training step reaches the user as itself, in every layout. Under ZeRO-2/3 a forward or
backward that raised left FSDP2's root gathered; Lightning's teardown then moved the module to the host, FSDP2
failed on it ("'Parameter' object has no attribute '_local_tensor'"), and that error was what the user read (found
by a new user's audit, 2026-12-01: a model of a width the experts' kernel refuses, or sequences past
``max_seq_len``, showed only the teardown's error)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy

TINY = M6Config(vocab_size=64, max_seq_len=16, num_layers=2, dim=32, num_heads=2, num_experts=2)


class FailsAtStep(M6LanguageModel):
    """Raises from the first block's forward, or from its output's gradient, at the second step."""

    def __init__(self, where: str) -> None:
        super().__init__(TINY, OptimizerConfig(warmup_steps=1))
        self.where = where

    def on_fit_start(self) -> None:
        self.transformer.blocks[0].register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.trainer.global_step != 1:
            return None
        if self.where == "forward":
            raise RuntimeError("the user's error in forward")
        out = output[0] if isinstance(output, tuple) else output

        def fail(grad):
            raise RuntimeError("the user's error in backward")
        out.register_hook(fail)
        return None


def _fit(module: M6LanguageModel, strategy: P2RStrategy) -> None:
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(
        module, DataLoader(torch.randint(0, 64, (16, 17)), batch_size=4))


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("options", [{"sharding": "zero2"}, {"sharding": "zero3"},
                                     {"sharding": "zero3", "offload_fraction": 0.5},
                                     {"sharding": "zero3", "accumulation": "layered", "micro_batches": 2}],
                         ids=["zero2", "zero3", "zero3_offload", "zero3_layered"])
def test_an_error_in_a_sharded_step_reaches_the_user_as_itself(where: str, options: dict) -> None:
    module = FailsAtStep(where)
    with pytest.raises(RuntimeError, match=f"the user's error in {where}") as raised:
        _fit(module, P2RStrategy(**options))
    assert "_local_tensor" not in str(raised.value.__context__ or "")  # no teardown error chained after it
    assert all(not p.is_meta and p.device.type == "cpu" for p in module.parameters())


def test_a_teardown_that_fails_after_an_error_warns_and_lets_the_error_through(monkeypatch) -> None:
    """The net under it: on a torch without ``FSDPModule.reset_iter_state`` (before 2.12) the root stays gathered."""
    from lightning_p2r.strategy.engines import fsdp2

    monkeypatch.setattr(fsdp2, "recover_from_error", lambda module, root: None)
    with pytest.warns(UserWarning, match="after the run stopped on RuntimeError, teardown could not move"), \
            pytest.raises(RuntimeError, match="the user's error in forward"):
        _fit(FailsAtStep("forward"), P2RStrategy(sharding="zero3"))
