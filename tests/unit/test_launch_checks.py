"""What the options, the model config, the data's batch size and the number of processes decide is refused by
``trainer.fit`` in the launching process, before Lightning's launcher starts any other rank (issue 27)."""

from pathlib import Path

import pytest
from helpers import TINY, tiny_data, tiny_trainer

from lightning_p2r import M6Config, M6LanguageModel, P2RStrategy
from lightning_p2r.strategy.launch import read_rank_errors, summarize, write_rank_error

CASES = {
    "tensor degree": ({"tensor_parallel": 2}, {}, 3, r"tensor_parallel=2\) must divide the number of processes \(3\)"),
    "expert degree": ({"expert_parallel": 2}, {}, 3, r"expert_parallel"),
    "pipeline fill": ({"pipeline_parallel": 2, "micro_batches": 1}, {}, 2,
                      r"micro_batches=1\) is fewer than pipeline_parallel=2"),
    "stage cut": ({"pipeline_parallel": 2, "stages_per_rank": 2, "pipeline_schedule": "looped_bfs",
                   "micro_batches": 2}, {"num_layers": 6}, 2,
                  r"6 layers cannot be cut into .* 4 stages"),
    "heads": ({"tensor_parallel": 2}, {"num_heads": 1}, 2, r"num_heads"),
    "experts": ({"expert_parallel": 2}, {"num_experts": 3}, 2, r"num_experts"),
    "batch split": ({"accumulation": "layered", "micro_batches": 3}, {}, 1, r"micro_batches=3\) must divide the batch"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_layout_is_refused_before_any_rank_starts(case: str, tmp_path: Path) -> None:
    options, model, devices, message = CASES[case]
    trainer = None
    with pytest.raises(ValueError, match=message):  # when the strategy is built, or when fit begins
        trainer = tiny_trainer(tmp_path, devices=devices, strategy=P2RStrategy(**options))
        trainer.fit(M6LanguageModel(M6Config(**(TINY | model))), datamodule=tiny_data(tmp_path, batch_size=4))
    assert trainer is None or getattr(trainer.strategy.launcher, "procs", []) == []  # no child process started


def test_the_ranks_errors_are_summarized_once_per_distinct_text() -> None:
    errors = {1: "ValueError: x", 2: "ValueError: x", 3: "RuntimeError: y"}
    assert summarize(errors) == ["ranks 1, 2: ValueError: x", "rank 3: RuntimeError: y"]
    assert summarize(errors, skip="ValueError: x") == ["rank 3: RuntimeError: y"]


def test_a_rank_error_is_read_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launching process stops the other ranks as soon as its own error is raised; a rank stopped mid-write used
    to leave an empty file, reported as a bare ``rank 1:`` line under the error (a damaged checkpoint resumed on 2
    processes)."""
    write_rank_error(tmp_path, 1, "ValueError: rank 1's refusal")
    assert read_rank_errors(tmp_path) == {1: "ValueError: rank 1's refusal"}

    def stopped(*args: object) -> None:
        raise KeyboardInterrupt  # the rank terminated between writing and renaming

    monkeypatch.setattr("os.replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_rank_error(tmp_path, 2, "ValueError: rank 2's refusal")
    assert read_rank_errors(tmp_path) == {1: "ValueError: rank 1's refusal"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank-1.txt"]


def test_a_one_process_fit_runs_on_one_thread(tmp_path: Path) -> None:
    """One process has no other rank to watch, so the launcher starts no observer thread: prepare_data then forks
    litdata's workers directly (lightning_p2r.data.prepared.token_writer) instead of spawning a helper interpreter,
    which costs seconds of imports."""
    import threading

    import lightning as L

    seen: list[list[str]] = []

    class Threads(L.Callback):
        def on_train_start(self, *args) -> None:
            seen.append(sorted(thread.name for thread in threading.enumerate()))

    trainer = tiny_trainer(tmp_path, strategy=P2RStrategy(), callbacks=[Threads()], max_steps=1)
    trainer.fit(M6LanguageModel(M6Config(**TINY)), datamodule=tiny_data(tmp_path))
    assert seen and not any("p2r-rank-observer" in names for names in seen), seen


def _two_processes(strategy: P2RStrategy) -> P2RStrategy:
    """The strategy as a Trainer on two CPU devices hands it to the launcher."""
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 1
    return strategy


QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
CAUSAL_LM_CASES = {
    "heads": ({"tensor_parallel": 2}, QWEN3_MOE | {"num_attention_heads": 3, "num_key_value_heads": 3},
              r"tensor_parallel=2\) splits attention by heads: CausalLMModule.hf_config's num_attention_heads=3 "),
    "key/value heads": ({"tensor_parallel": 2}, QWEN3_MOE | {"num_key_value_heads": 1},
                        r"tensor_parallel=2\) .* CausalLMModule.hf_config's num_key_value_heads=1 must be divisible"),
    "experts": ({"expert_parallel": 2}, QWEN3_MOE | {"num_experts": 3},
                r"expert_parallel=2\) .* CausalLMModule.hf_config's num_local_experts=3 \(or num_experts\) must be "),
    "dense": ({"expert_parallel": 2}, LLAMA,
              r"expert_parallel=2\) needs MoE layers, and CausalLMModule.hf_config has none \(it sets no num_experts"),
    "gpt2": ({"tensor_parallel": 2}, {"model_type": "gpt2", "vocab_size": 64, "n_head": 3, "n_embd": 48, "n_layer": 2},
             r"CausalLMModule.hf_config's n_head=3 \(or num_attention_heads\) must be divisible"),
    "llama width": ({"tensor_parallel": 2}, LLAMA | {"intermediate_size": 63},
                    r"CausalLMModule.hf_config's intermediate_size=63 must be divisible"),
}


@pytest.mark.parametrize("case", CAUSAL_LM_CASES, ids=list(CAUSAL_LM_CASES))
def test_a_causal_lm_config_the_degrees_cannot_split_is_refused_before_launch(case: str) -> None:
    """CausalLMModule states its config's sizes (protocols.StatesShape): the launching process refuses them by the
    config's own field names, as it does an M6 model's, instead of every rank failing once it has built the model."""
    from lightning_p2r import CausalLMModule

    options, hf_config, message = CAUSAL_LM_CASES[case]
    module = CausalLMModule(hf_config=hf_config)
    with pytest.raises(ValueError, match=message):
        _two_processes(P2RStrategy(**options)).check_before_launch(None, module)


def test_the_tests_hugging_face_configs_pass_the_check_before_launch() -> None:
    """The stated sizes refuse nothing placement runs: each test family (Hugging Face's, litgpt's) with
    tensor_parallel=2 (and
    expert_parallel=2 where it has experts) passes, a model given whole is stated from its own config, and a model
    without one states nothing (placement checks it)."""
    import torch
    from hf_models import CONFIGS, LITGPT_CONFIGS

    from lightning_p2r import CausalLMModule
    from lightning_p2r.layout import ModelShape

    modules = {name: CausalLMModule(hf_config=config) for name, config in CONFIGS.items()}
    modules |= {name: CausalLMModule(litgpt_config=config) for name, config in LITGPT_CONFIGS.items()}
    for name, module in modules.items():
        shape = module.model_shape()
        assert isinstance(shape, ModelShape) and shape.num_heads == 4 and shape.num_layers == 4, name
        for options in [{"tensor_parallel": 2}] + ([{"expert_parallel": 2}] if shape.moe else []):
            _two_processes(P2RStrategy(**options)).check_before_launch(None, module)
    assert CausalLMModule(model=torch.nn.Linear(2, 2)).model_shape() is None


def test_a_users_module_that_states_its_shape_is_checked_before_launch() -> None:
    """docs/your_model.md: a LightningModule of one's own states its config's sizes with ``model_shape()``."""
    import lightning as L

    from lightning_p2r.causal_lm import read_causal_lm_config
    from lightning_p2r.layout import ModelShape

    config = read_causal_lm_config(LLAMA | {"num_key_value_heads": 1})

    class MyModule(L.LightningModule):
        def model_shape(self) -> ModelShape:
            return ModelShape.of_hf_config(config, "MyModule's config")

    with pytest.raises(ValueError, match=r"MyModule's config's num_key_value_heads=1 must be divisible"):
        _two_processes(P2RStrategy(tensor_parallel=2)).check_before_launch(None, MyModule())


def test_an_errors_folder_left_by_a_killed_launch_is_removed_by_the_next(tmp_path: Path) -> None:
    """A launching process that was killed cannot remove its errors folder; the next launch removes the folders of
    processes that are gone, and keeps a running one's (its own, or any whose id is in use)."""
    import os
    import subprocess
    import sys

    from lightning_p2r.strategy.launch import ERRORS_PREFIX, remove_abandoned_error_folders

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f"{ERRORS_PREFIX}{int(gone.stdout)}-abc"
    running = tmp_path / f"{ERRORS_PREFIX}{os.getpid()}-def"
    unknown = tmp_path / f"{ERRORS_PREFIX}x1y2z3"  # not named by a process id: not ours to judge
    for folder in (abandoned, running, unknown):
        folder.mkdir()
    write_rank_error(abandoned, 1, "ValueError: x")
    assert remove_abandoned_error_folders(tmp_path) == [abandoned]
    assert not abandoned.exists() and running.is_dir() and unknown.is_dir()
