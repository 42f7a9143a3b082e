"""The planner's tensor-parallel traffic under mixed precision, against the runs' own counters: autocast computes a
linear layer's output in bf16, but the residual stream, a norm's output and their gradients stay fp32, so a row
layer's sums move 2 bytes an element while a column layer's input-gradient sums, the sequence's gathers, the
embedding's and the head's move 4 (the planner priced them all at 2 until 2026-12-01: for a two-layer dense M6 at
tp2, 83 KB of all-reduces where the ranks moved 133 KB). For M6 and for Hugging Face decoders, with sequence
parallelism, MoE layers, layered accumulation and recompute; and under ``bf16-true``, where Lightning casts the
module and everything, ZeRO's parameters and gradients included, moves 2 bytes an element (priced as bf16-mixed's
fp32 parameters until 2026-12-01: 1.3 to 2 times the bytes counted)."""

import json
from pathlib import Path

import pytest
from worker_launch import launch_configs

from lightning_p2r import M6Config
from lightning_p2r.planning import Cluster, Workload, bytes_by_kind, step_transfers
from lightning_p2r.planning.cli import layout_from_options
from lightning_p2r.planning.transfers import COLLECTIVES

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

WORKER = Path(__file__).with_name("mixed_precision_worker.py")
SEQUENCE_RECOMPUTE = {"tensor_parallel": 2, "sequence_parallel": True, "accumulation": "layered", "micro_batches": 2,
                      "recompute": True}
CONFIGS = [
    {"name": "m6_moe_tp2_sp_recompute", "model": {"num_layers": 2, "dim": 32, "num_heads": 4, "vocab_size": 256,
                                                   "max_seq_len": 32, "num_experts": 4, "moe_top_k": 2},
     "strategy": SEQUENCE_RECOMPUTE},
    {"name": "qwen3_moe_tp2_sp_recompute", "strategy": SEQUENCE_RECOMPUTE,
     "hf_config": {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                   "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 8, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64}},
    {"name": "llama_tp2", "strategy": {"tensor_parallel": 2},
     "hf_config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
                   "max_position_embeddings": 64}},
]
LLAMA = CONFIGS[-1]["hf_config"]
CONFIGS += [  # a tied head (GPT-2's and a tied Llama's embedding split by vocabulary with it), GPT-2's packed c_attn
    # (its weight and bias gathered per forward at the parameters' width), a dense Qwen2 (biases on q, k, v)
    {"name": "gpt2_tp2_sp", "strategy": {"tensor_parallel": 2, "sequence_parallel": True},
     "hf_config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
                   "vocab_size": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
    {"name": "llama_tied_tp2_sp", "strategy": {"tensor_parallel": 2, "sequence_parallel": True},
     "hf_config": LLAMA | {"tie_word_embeddings": True}},
    {"name": "qwen2_tp2", "strategy": {"tensor_parallel": 2}, "hf_config": LLAMA | {"model_type": "qwen2"}},
]
CONFIGS += [  # bf16-true: Lightning casts the module, so everything moves bf16, ZeRO's parameters and gradients too
    {"name": "m6_moe_tp2_sp_recompute_bf16_true", "model": CONFIGS[0]["model"], "strategy": SEQUENCE_RECOMPUTE,
     "precision": "bf16-true"},
    {"name": "llama_tp2_zero3_bf16_true", "strategy": {"tensor_parallel": 2, "sharding": "zero3"}, "hf_config": LLAMA,
     "precision": "bf16-true"},
    {"name": "m6_zero2_layered_bf16_true", "model": CONFIGS[0]["model"] | {"num_experts": 1, "moe_top_k": 1},
     "strategy": {"sharding": "zero2", "accumulation": "layered", "micro_batches": 2}, "precision": "bf16-true"},
]
CONFIGS = [{"precision": "bf16-mixed", "global_batch": 4, "seq_len": 32} | config for config in CONFIGS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed_precision")
    launch_configs(WORKER, out, 2, CONFIGS)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_mixed_precision_tensor_parallel_bytes_are_what_the_ranks_move(runs: Path, config: dict) -> None:
    from lightning_p2r.planning.hf_decoder import hf_decoder_of

    model = hf_decoder_of(config["hf_config"]) if "hf_config" in config else M6Config(**config["model"])
    transfers = step_transfers(model, layout_from_options(config["strategy"]),
                               Cluster(devices=2, devices_per_node=2, accelerator="cpu"),
                               Workload(global_batch=config["global_batch"], seq_len=config["seq_len"],
                                        precision=config["precision"]))
    predicted = bytes_by_kind(transfers, COLLECTIVES)
    for rank in json.loads((runs / f"{config['name']}.json").read_text()):
        assert {kind: value for kind, value in rank["bytes"].items() if kind in COLLECTIVES} == predicted
