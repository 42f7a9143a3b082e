"""``lightning-p2r generate`` on what a two-stage pipeline run wrote, through the console script as a user runs it:
the sharded checkpoint (each rank wrote its own stage) is read as it is, recites the sentence the model memorized,
and generates the same text as its ``convert-checkpoint`` single file; a refused input ends with one line and exit
status 2."""

from pathlib import Path

import pytest
import yaml
from recipe_runs import run_command

from lightning_p2r.strategy.checkpoint import is_sharded_checkpoint

SENTENCE = "In the beginning God created the heaven and the earth. "
SEQ_LEN = 32


def _pipeline_recipe(root: Path) -> Path:
    corpus = root / "corpus.txt"
    corpus.write_text(SENTENCE * 60, encoding="utf-8")
    recipe = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 150, "limit_val_batches": 0, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(root / "run"),
                    "strategy": {"class_path": "lightning_p2r.P2RStrategy",
                                 "init_args": {"pipeline_parallel": 2, "micro_batches": 2}},
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"save_last": True, "every_n_train_steps": 150}}]},
        # A dense layer with banded attention on stage 0, an MoE layer whose capacity drops tokens in training on
        # stage 1.
        "model": {"config": {"num_layers": 2, "dim": 48, "num_heads": 4, "moe_layers": [1], "num_experts": 4,
                             "capacity_factor": 1.0, "attention": "alternating", "sparse_window": 8, "init_seed": 0},
                  "optimizer": {"lr": 0.01, "warmup_steps": 10}},
        "data": {"corpus": str(corpus), "tokenizer": "bytes", "seq_len": SEQ_LEN, "batch_size": 8,
                 "cache_dir": str(root / "cache")},
    }
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_pipeline_runs_sharded_checkpoint_generates_what_its_single_file_conversion_does(tmp_path: Path) -> None:
    recipe = _pipeline_recipe(tmp_path)
    fit = run_command(["fit", "--config", str(recipe)], tmp_path, timeout=300)
    assert fit.returncode == 0, fit.stderr[-4000:]
    assert "pipeline: 2 ranks" in fit.stdout + fit.stderr
    sharded = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(sharded)
    assert {p.name for p in sharded.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # each stage's rank
    single = tmp_path / "single.ckpt"
    convert = run_command(["convert-checkpoint", str(sharded), str(single)], tmp_path)
    assert convert.returncode == 0, convert.stderr[-4000:]

    def generate(ckpt: Path | str, *options: str) -> str:
        result = run_command(["generate", "--config", str(recipe), "--ckpt_path", str(ckpt), *options], tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        assert " tokens/s (prompt " in result.stderr
        return result.stdout

    greedy = ["--prompt", SENTENCE[:12], "--temperature", "0"]
    assert generate(sharded, *greedy) == (SENTENCE * 2)[:SEQ_LEN] + "\n"
    assert generate(single, *greedy) == (SENTENCE * 2)[:SEQ_LEN] + "\n"
    sampled = ["--prompt", "the heaven", "--temperature", "1.5", "--top_k", "20", "--seed", "5"]
    from_sharded = generate(sharded, *sampled)
    assert from_sharded == generate(single, *sampled) == generate("last", *sampled)

    refused = run_command(["generate", "--config", str(recipe), "--ckpt_path", str(sharded), "--prompt", "In",
                           "--max_new_tokens", "40"], tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[1].startswith(
        "lightning-p2r generate: error: --max_new_tokens: max_new_tokens=40 runs past the model's context")
