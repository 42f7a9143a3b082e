"""Hugging Face models in the multi-process layouts (issue 38): a tiny Qwen3-MoE and a Llama with a tied head (and
the other families of tests/unit/hf_models.py, those without a ready declaration included),
built in place by ``CausalLMModule`` (meta device, each rank materializing its share with the model's own
initialization), trained on 2 processes like the eager build on one: DDP, ZeRO-3 with offload, layered accumulation,
and a 2-stage pipeline derived from the model's declaration; every tensor two ranks hold is equal on both. Pipeline x
tensor parallelism runs on 4 processes.

Two ranks sum in another order than one process, so the weights are compared as tests/unit/equivalence.py explains:
each tensor within 1% of how far training moved it, in norm (``measure="norm"``). A fixed tolerance failed on one
element in 1,024 (tp2_llama, 2.0e-4 against an atol of 1e-4), and so does the largest element's share of the
movement (1.5% on one element of the head). In norm the tensors differed by at most 4.6e-4 of their
movement (that head), the other layouts' by 2.8e-4 or less."""

import sys
from pathlib import Path

import pytest
import torch
from rank_slices import read_report
from worker_launch import launch_configs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from equivalence import assert_trained_alike  # noqa: E402
from hf_models import CONFIGS  # noqa: E402

from lightning_p2r.planning.hf_decoder import PRICED_FAMILIES  # noqa: E402
from lightning_p2r.planning.transfers import bytes_by_kind  # noqa: E402

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
pytest.importorskip("litgpt", reason="litgpt is not installed (pip install --no-deps litgpt)")

WORKER = Path(__file__).with_name("hf_worker.py")
GLOBAL_BATCH, SEQ_LEN = 4, 16
"""The worker's batch of token windows and the tokens the model reads from each (``hf_models.windows``)."""

GROWN = {"module": {"num_unique_blocks": 2, "pseudo_depth": "shallow", "growth_init": "zero_outputs"}, "delink_at": 2}
"""A shallow pseudo model of 2 layers grown to the real 4 by PseudoToReal at step 2 (issue 38 item 6)."""
SHARED = {"module": {"num_unique_blocks": 2}, "delink_at": 2}
"""A pseudo model whose 4 layers share 2 blocks, delinked by PseudoToReal at step 2."""

ONE_PROCESS = [{"name": f"reference_{family}", "family": family, "strategy": None}
               for family in ("qwen3_moe", "llama_tied", "llama", "gpt2", "mixtral", "litgpt", "qwen3", "qwen2_moe",
                              "mistral", "litgpt_gqa", "nanogpt", "litgpt_moe", "qwen3_sliding", "gemma3",
                              "gpt_neox", "olmoe", "olmo2", "deepseek_v3", "granite", "bloom")] + [
    {"name": "reference_grown_qwen3_moe", "family": "qwen3_moe", "strategy": None, **GROWN},
    {"name": "reference_grown_qwen3", "family": "qwen3", "strategy": None, **GROWN},
    {"name": "reference_shared_litgpt_gqa", "family": "litgpt_gqa", "strategy": None, **SHARED},
    {"name": "reference_shared_llama", "family": "llama", "strategy": None, **SHARED},
    {"name": "reference_shared_qwen3", "family": "qwen3", "strategy": None, **SHARED},
    {"name": "reference_shared_granite", "family": "granite", "strategy": None, **SHARED},
    {"name": "reference_grown_gemma3", "family": "gemma3", "strategy": None, **GROWN},
    # The load-balancing loss is computed over the rows of one forward: layouts whose ranks see the same rows (tensor
    # parallelism) compare with one forward over the global batch, layouts whose data ranks or micro-batches each
    # see their own rows with a plain Trainer accumulating those same rows.
    {"name": "reference_qwen3_moe_balanced", "family": "qwen3_moe_balanced", "strategy": None},
    {"name": "reference_accumulated_qwen3_moe_balanced", "family": "qwen3_moe_balanced", "strategy": None,
     "accumulate": 2},
    {"name": "reference_accumulated4_qwen3_moe_balanced", "family": "qwen3_moe_balanced", "strategy": None,
     "accumulate": 4},
    {"name": "reference_accumulated_shared_qwen3_moe_balanced", "family": "qwen3_moe_balanced", "strategy": None,
     "accumulate": 2, **SHARED}]
TWO_PROCESSES = [
    {"name": "ddp_qwen3_moe", "family": "qwen3_moe", "strategy": {}},
    {"name": "zero3_offload_qwen3_moe", "family": "qwen3_moe",
     "strategy": {"sharding": "zero3", "offload_fraction": 0.5}},
    {"name": "zero3_offload_layered_llama_tied", "family": "llama_tied",
     "strategy": {"sharding": "zero3", "offload_fraction": 0.5, "accumulation": "layered", "micro_batches": 2}},
    {"name": "pp2_qwen3_moe", "family": "qwen3_moe", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "pp2_llama_tied", "family": "llama_tied",
     "strategy": {"pipeline_parallel": 2, "micro_batches": 2, "pipeline_schedule": "gpipe"}},
    # The model's own Hugging Face plan (base_model_tp_plan and the head's _tp_plan); a tied head splits its
    # embedding by vocabulary with it.
    {"name": "tp2_llama", "family": "llama", "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_zero3_llama_tied", "family": "llama_tied", "strategy": {"tensor_parallel": 2, "sharding": "zero3"}},
    # The same from a user's own LightningModule (OwnCausalLM): the strategy detects the layers in the base model and
    # declares them on the causal LM, whose plan splits the head (on the base model the tie was refused).
    {"name": "tp2_zero3_own_module_llama_tied", "family": "llama_tied", "own_module": True,
     "strategy": {"tensor_parallel": 2, "sharding": "zero3"}, "reference": "reference_llama_tied"},
    # Qwen3's per-head norms (HF's "replicated_with_grad_allreduce"): whole on each rank's heads, gradients summed.
    {"name": "tp2_qwen3", "family": "qwen3", "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_zero3_qwen3", "family": "qwen3", "strategy": {"tensor_parallel": 2, "sharding": "zero3"}},
    {"name": "zero1_gpt2", "family": "gpt2", "strategy": {"sharding": "zero1"}},
    {"name": "pp2_gpt2", "family": "gpt2", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "zero2_layered_mixtral", "family": "mixtral",
     "strategy": {"sharding": "zero2", "accumulation": "layered", "micro_batches": 2}},
    {"name": "pp2_mixtral", "family": "mixtral", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    # The experts split by the model's own expert-parallel plan (base_model_ep_plan: stacked gate_up_proj/down_proj).
    {"name": "ep2_qwen3_moe", "family": "qwen3_moe", "strategy": {"expert_parallel": 2}},
    {"name": "ep2_zero3_offload_mixtral", "family": "mixtral",
     "strategy": {"expert_parallel": 2, "sharding": "zero3", "offload_fraction": 0.5}},
    {"name": "ep2_zero1_mixtral", "family": "mixtral", "strategy": {"expert_parallel": 2, "sharding": "zero1"}},
    {"name": "ep2_zero2_layered_qwen3_moe", "family": "qwen3_moe",
     "strategy": {"expert_parallel": 2, "sharding": "zero2", "accumulation": "layered", "micro_batches": 2}},
    # Growth of a foreign decoder under ZeRO-3: the gather, stacking and re-sharding of the grown model.
    {"name": "zero3_grown_qwen3_moe", "family": "qwen3_moe", "reference": "reference_grown_qwen3_moe",
     "strategy": {"sharding": "zero3"}, **GROWN},
    {"name": "zero3_offload_layered_litgpt", "family": "litgpt",
     "strategy": {"sharding": "zero3", "offload_fraction": 0.5, "accumulation": "layered", "micro_batches": 2}},
    # litgpt's GPT holds its rotary tables above the blocks' root on the first stage, and is itself the module whose
    # forward runs the blocks (the pipeline's evaluation replaces it): both once broke its pipeline (NaN, a hang).
    {"name": "pp2_litgpt", "family": "litgpt", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "zero1_litgpt", "family": "litgpt", "strategy": {"sharding": "zero1"}},
    # Cells the layouts above leave empty (a sweep of 68 family x layout pairs matched once, docs/your_model.md).
    {"name": "zero1_offload_llama", "family": "llama", "strategy": {"sharding": "zero1", "offload_fraction": 0.5}},
    {"name": "zero3_gpt2", "family": "gpt2", "strategy": {"sharding": "zero3"}},
    {"name": "none_mixtral", "family": "mixtral", "strategy": {}},
    {"name": "pp2_interleaved_litgpt", "family": "litgpt", "strategy": {
        "pipeline_parallel": 2, "micro_batches": 2, "pipeline_schedule": "interleaved_1f1b", "stages_per_rank": 2}},
    {"name": "tp2_layered_qwen3", "family": "qwen3", "strategy": {"tensor_parallel": 2, "accumulation": "layered",
                                                                  "micro_batches": 2}},
    # Recompute under tensor parallelism: every collective a layer's forward issues, issued again.
    {"name": "tp2_layered_recompute_qwen3_moe", "family": "qwen3_moe",
     "strategy": {"tensor_parallel": 2, "accumulation": "layered", "micro_batches": 2, "recompute": True}},
    # Stacked experts with gate and up packed in one tensor (HF's "packed_colwise"), under tensor parallelism: each rank
    # runs whole experts, half of them, on the tokens routed there; the MoE block sees the whole sequence under
    # sequence parallelism.
    {"name": "tp2_qwen3_moe", "family": "qwen3_moe", "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_sequence_parallel_zero3_mixtral", "family": "mixtral",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3"}},
    # Qwen2-MoE: a shared expert with its own gate beside the routed experts, dense layers between the MoE ones.
    {"name": "tp2_sequence_parallel_qwen2_moe", "family": "qwen2_moe",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True}},
    {"name": "ep2_zero3_qwen2_moe", "family": "qwen2_moe", "strategy": {"expert_parallel": 2, "sharding": "zero3"}},
    # litgpt's packed qkv (each rank computes its heads' share of q, k and v) and its head counts read from its config
    # (each attention gets the rank's): multi-head, and grouped queries with a gated MLP under sequence parallelism,
    # ZeRO-3 and layered accumulation.
    {"name": "tp2_litgpt", "family": "litgpt", "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_sequence_parallel_zero3_layered_litgpt_gqa", "family": "litgpt_gqa",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}},
    # GPT-2's Conv1D layers (weights stored in x out) by the package's plan: c_attn packed like litgpt's qkv, the tied
    # head and embedding split alike.
    {"name": "tp2_gpt2", "family": "gpt2", "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_zero3_layered_gpt2", "family": "gpt2",
     "strategy": {"tensor_parallel": 2, "sharding": "zero3", "accumulation": "layered", "micro_batches": 2}},
    # Pseudo-to-Real under tensor parallelism: a shallow model grown, and shared layers (one block registered under
    # several layers' names, split once) delinked, re-placed with the model's plan.
    {"name": "tp2_grown_qwen3", "family": "qwen3", "reference": "reference_grown_qwen3",
     "strategy": {"tensor_parallel": 2}, **GROWN},
    {"name": "tp2_shared_litgpt_gqa", "family": "litgpt_gqa", "reference": "reference_shared_litgpt_gqa",
     "strategy": {"tensor_parallel": 2}, **SHARED},
    # Mistral's sliding window under sequence parallelism: the mask comes from the whole sequence on every rank.
    {"name": "tp2_sequence_parallel_zero3_mistral", "family": "mistral",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3"}},
    # Sequence parallelism of HF models: the attention and the MLP gather the sequence at their entry, the norms run
    # on the rank's positions (the strategy adds both to HF's plan), the first block cuts its input.
    {"name": "tp2_sequence_parallel_llama", "family": "llama",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True}},
    {"name": "tp2_sequence_parallel_qwen3", "family": "qwen3",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True}},
    {"name": "tp2_sequence_parallel_zero3_layered_llama_tied", "family": "llama_tied",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}},
    # A user's own decoder (no config, learned positions, a tied head), given whole with its DecoderParts.
    {"name": "pp2_nanogpt", "family": "nanogpt", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "zero3_layered_nanogpt", "family": "nanogpt",
     "strategy": {"sharding": "zero3", "accumulation": "layered", "micro_batches": 2}},
]

FOUR_PROCESSES = [
    # Pipeline x tensor parallelism: a tied head across the stages (the head-less first stage splits its embedding by
    # vocabulary too), and sequence parallelism through the stages.
    {"name": "pp2_tp2_llama_tied", "family": "llama_tied",
     "strategy": {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "pp2_tp2_sequence_parallel_qwen3", "family": "qwen3",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "pp2_tp2_gpt2", "family": "gpt2",
     "strategy": {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "pp2_tp2_sequence_parallel_litgpt", "family": "litgpt",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2, "micro_batches": 2}},
    # tp2 x ZeRO-3 over 2 data ranks: FSDP2 shards the packed qkv's tensor-parallel rows further.
    {"name": "tp2_dp2_zero3_sequence_parallel_litgpt_gqa", "family": "litgpt_gqa",
     "strategy": {"tensor_parallel": 2, "sharding": "zero3", "sequence_parallel": True}},
    # Experts split by expert over both the expert- and the tensor-parallel ranks: one of the four on each rank.
    {"name": "tp2_ep2_qwen3_moe", "family": "qwen3_moe", "strategy": {"tensor_parallel": 2, "expert_parallel": 2}},
    {"name": "pp2_tp2_sequence_parallel_shared_qwen3", "family": "qwen3",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2, "micro_batches": 2},
     "reference": "reference_shared_qwen3", **SHARED},
    {"name": "pp2_tp2_sequence_parallel_gpt2", "family": "gpt2",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2, "micro_batches": 2}},
    {"name": "tp2_ep2_deepseek_v3", "family": "deepseek_v3", "strategy": {"tensor_parallel": 2, "expert_parallel": 2}},
    {"name": "pp2_tp2_granite", "family": "granite",
     "strategy": {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}},
]
LITGPT_MOE_TWO_PROCESSES = [
    # litgpt's MoE: a list of expert modules, each split by hidden unit (its router whole), a shared expert, a dense
    # first layer.
    {"name": "tp2_litgpt_moe", "family": "litgpt_moe", "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_sequence_parallel_zero3_layered_litgpt_moe", "family": "litgpt_moe",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}},
]
TWO_PROCESSES += LITGPT_MOE_TWO_PROCESSES
BALANCED_TWO_PROCESSES = [
    # The load-balancing loss (output_router_logits=True): each data rank's over its own rows, as Hugging Face
    # computes it per forward; under layered accumulation per micro-batch, its gradient applied once every layer ran.
    {"name": "ddp_qwen3_moe_balanced", "family": "qwen3_moe_balanced", "strategy": {},
     "reference": "reference_accumulated_qwen3_moe_balanced"},
    {"name": "ep2_zero3_qwen3_moe_balanced", "family": "qwen3_moe_balanced",
     "strategy": {"expert_parallel": 2, "sharding": "zero3"}, "reference": "reference_accumulated_qwen3_moe_balanced"},
    {"name": "zero2_offload_layered_qwen3_moe_balanced", "family": "qwen3_moe_balanced",
     "strategy": {"sharding": "zero2", "offload_fraction": 0.5, "accumulation": "layered", "micro_batches": 2},
     "reference": "reference_accumulated4_qwen3_moe_balanced"},
    {"name": "tp2_sequence_parallel_qwen3_moe_balanced", "family": "qwen3_moe_balanced",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True}},
]
TWO_PROCESSES += BALANCED_TWO_PROCESSES
SHARED_TWO_PROCESSES = [
    # Pseudo-to-Real of a foreign decoder in stages: layered accumulation ran the model's list at each unique block's
    # number (the wrong block where consecutive layers share), and a pipeline failed at setup, then at delinking.
    {"name": "zero3_layered_shared_qwen3_moe_balanced", "family": "qwen3_moe_balanced",
     "strategy": {"sharding": "zero3", "accumulation": "layered", "micro_batches": 1, "recompute": True},
     "reference": "reference_accumulated_shared_qwen3_moe_balanced", **SHARED},
    {"name": "pp2_shared_llama", "family": "llama", "strategy": {"pipeline_parallel": 2, "micro_batches": 2},
     "reference": "reference_shared_llama", **SHARED},
    # GPT-2's transposed Conv1D layers under sequence parallelism (the final norm gathers the sequence whole)
    {"name": "tp2_sequence_parallel_zero3_layered_gpt2", "family": "gpt2",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}},
    # A shared first block under sequence parallelism: cut to the rank's positions at its first layer only (the
    # later layers' input is shorter than the embedding's output); it crashed on a shape mismatch before.
    {"name": "tp2_sequence_parallel_zero3_layered_shared_qwen3", "family": "qwen3",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}, "reference": "reference_shared_qwen3", **SHARED},
    # Layers called with other masks (sliding windows on the second stage's layers only): each stage records its
    # layers' own arguments.
    {"name": "pp2_qwen3_sliding", "family": "qwen3_sliding", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
]
TWO_PROCESSES += SHARED_TWO_PROCESSES
DISCOVERED_TWO_PROCESSES = [
    # Families without a ready declaration, their parts found from Hugging Face's conventions (models/hf_parts.py).
    # Gemma 3: an embedding scaled by a buffer its _init_weights recomputes, sliding-window layers, per-head norms.
    {"name": "tp2_sequence_parallel_zero3_gemma3", "family": "gemma3",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3"}},
    {"name": "pp2_gemma3", "family": "gemma3", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    # GPT-NeoX: its plan splits the input embedding by vocabulary ("embedding_rowwise").
    {"name": "tp2_sequence_parallel_zero3_layered_gpt_neox", "family": "gpt_neox",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}},
    {"name": "ep2_zero3_olmoe", "family": "olmoe", "strategy": {"expert_parallel": 2, "sharding": "zero3"}},
    # OLMo 2 / OLMoE: q/k norms over all heads, so their plans gather q, k and v whole and split o_proj's input.
    {"name": "tp2_sequence_parallel_zero3_layered_olmo2", "family": "olmo2",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True, "sharding": "zero3", "accumulation": "layered",
                  "micro_batches": 2}},
    {"name": "tp2_sequence_parallel_olmoe", "family": "olmoe",
     "strategy": {"tensor_parallel": 2, "sequence_parallel": True}},
    {"name": "zero3_offload_layered_olmoe", "family": "olmoe",
     "strategy": {"sharding": "zero3", "offload_fraction": 0.5, "accumulation": "layered", "micro_batches": 2}},
    {"name": "ep2_zero3_deepseek_v3", "family": "deepseek_v3", "strategy": {"expert_parallel": 2, "sharding": "zero3"}},
    # Granite scales its logits after the head: the last stage computes them with the causal LM's own forward.
    {"name": "zero2_layered_granite", "family": "granite",
     "strategy": {"sharding": "zero2", "accumulation": "layered", "micro_batches": 2}},
    {"name": "pp2_granite", "family": "granite", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    # Bloom: a norm between the embedding and the first block, on the first stage (later stages pass it through).
    {"name": "pp2_bloom", "family": "bloom", "strategy": {"pipeline_parallel": 2, "micro_batches": 2}},
    # Pseudo-to-Real: a shared Granite delinked in a pipeline (re-placing it found no parts on a rank whose layer list
    # held the other rank's stand-ins), and a shallow Gemma 3 grown with its residual outputs (read from its plan)
    # zeroed.
    {"name": "pp2_shared_granite", "family": "granite", "strategy": {"pipeline_parallel": 2, "micro_batches": 2},
     "reference": "reference_shared_granite", **SHARED},
    {"name": "zero3_grown_gemma3", "family": "gemma3", "strategy": {"sharding": "zero3"},
     "reference": "reference_grown_gemma3", **GROWN},
]
TWO_PROCESSES += DISCOVERED_TWO_PROCESSES
# Checkpoints resharded between layouts: saved at step 2 under one layout, resumed to step 4 under another, against
# an uninterrupted run of 4 steps. Every step reads the same one batch (Lightning resumes a plain DataLoader from its
# first batch, whatever step the checkpoint was saved at), at a constant learning rate (a schedule follows
# max_steps, and the saved run's is shorter).
RESHARD = {"family": "qwen3_moe", "batches": 1, "optimizer": {"min_lr_ratio": 1.0}}
LITGPT_RESHARD = RESHARD | {"family": "litgpt_gqa"}
RESHARD_ONE = [RESHARD | {"name": "reference_one_batch_qwen3_moe", "strategy": None},
               RESHARD | {"name": "qwen3_moe_saved_on_one", "strategy": None, "steps": 2, "save": "one.ckpt"},
               LITGPT_RESHARD | {"name": "reference_one_batch_litgpt_gqa", "strategy": None},
               LITGPT_RESHARD | {"name": "litgpt_gqa_saved_on_one", "strategy": None, "steps": 2,
                                 "save": "litgpt_one.ckpt"}]
RESHARD_TWO = [RESHARD | {"name": "tp2_qwen3_moe_resumes_one_process", "strategy": {"tensor_parallel": 2},
                          "resume": "one.ckpt"},
               # litgpt's packed qkv, split in contiguous rows: the checkpoint keeps the model's own layout
               LITGPT_RESHARD | {"name": "tp2_sequence_parallel_litgpt_gqa_resumes_one_process",
                                 "strategy": {"tensor_parallel": 2, "sequence_parallel": True},
                                 "resume": "litgpt_one.ckpt"},
               RESHARD | {"name": "tp2_qwen3_moe_saved", "strategy": {"tensor_parallel": 2}, "steps": 2,
                          "save": "tp2.ckpt"}]
RESHARD_FOUR = [RESHARD | {"name": "tp2_ep2_qwen3_moe_resumes_tp2",
                           "strategy": {"tensor_parallel": 2, "expert_parallel": 2}, "resume": "tp2.ckpt"}]
MOE_FAMILIES = {"qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe_balanced", "olmoe", "deepseek_v3"}
"""Families whose stacked experts pack gate and up in one tensor: tensor parallelism splits them by expert."""


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_layouts")
    launch_configs(WORKER, out, 1, ONE_PROCESS + RESHARD_ONE)
    launch_configs(WORKER, out, 2, TWO_PROCESSES + RESHARD_TWO)
    launch_configs(WORKER, out, 4, FOUR_PROCESSES + RESHARD_FOUR)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", TWO_PROCESSES + FOUR_PROCESSES, ids=lambda c: c["name"])
def test_an_hf_model_built_in_place_trains_on_several_processes_like_the_eager_build_on_one(
        hf_runs: Path, config: dict) -> None:
    reference = read_report(hf_runs, config.get("reference", f"reference_{config['family']}"))
    run = read_report(hf_runs, config["name"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert reference["losses"][-1] < reference["losses"][0]
    expected = reference["ranks"][0]["weights"]
    merged: dict[str, torch.Tensor] = {}
    for rank in run["ranks"]:
        if rank["tied"] is not None:
            assert rank["tied"], "the head and the embedding are no longer one parameter"
        for name, values in rank["weights"].items():
            if name in merged:  # held by both ranks (a replica, a tied embedding on both pipeline ends): equal
                assert torch.equal(merged[name], values), f"{name} differs between the ranks holding it"
            merged[name] = values
    assert set(merged) == set(expected)
    initial = reference["ranks"][0]["initial"]
    assert set(initial) == set(expected)
    assert_trained_alike(merged, expected, initial, name=config["name"], measure="norm")
    strategy = config["strategy"]
    shares = strategy.get("expert_parallel", 1) * (strategy.get("tensor_parallel", 1)
                                                   if config["family"] in MOE_FAMILIES else 1)
    if shares > 1:  # each rank runs its share of every layer's experts
        assert all(rank["experts_held"] == [n // shares for n in reference["ranks"][0]["experts_held"]]
                   for rank in run["ranks"])
    if {"pipeline_parallel", "tensor_parallel"} & set(config["strategy"]) or config["strategy"].get("sharding") in (
            "zero2", "zero3"):
        for rank in run["ranks"]:  # built in place: no rank holds the whole model
            assert rank["held"] < 0.75 * reference["ranks"][0]["held"]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_users_own_module_around_an_hf_model_is_split_as_causal_lm_module_splits_it(hf_runs: Path) -> None:
    """Under tensor parallelism each rank holds the same share of the model from a user's own LightningModule as from
    CausalLMModule: the head too, split by vocabulary with the embedding it is tied to (left whole until the layers
    detected in the base model were declared on the causal LM around it)."""
    own = read_report(hf_runs, "tp2_zero3_own_module_llama_tied")
    ours = read_report(hf_runs, "tp2_zero3_llama_tied")
    assert [rank["held"] for rank in own["ranks"]] == [rank["held"] for rank in ours["ranks"]]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "family"), [("tp2_qwen3_moe_resumes_one_process", "qwen3_moe"),
                                              ("tp2_ep2_qwen3_moe_resumes_tp2", "qwen3_moe"),
                                              ("tp2_sequence_parallel_litgpt_gqa_resumes_one_process", "litgpt_gqa")])
def test_a_checkpoint_reshards_between_layouts(hf_runs: Path, name: str, family: str) -> None:
    """Saved on one process and resumed under tp2 (an MoE's experts split by expert over the tensor-parallel ranks;
    litgpt's packed qkv); saved under tp2 and resumed under tp2 x ep2 (one expert per rank): each continues with the
    uninterrupted run's losses."""
    reference = read_report(hf_runs, f"reference_one_batch_{family}")["losses"]
    resumed = read_report(hf_runs, name)["losses"]
    assert len(reference) == 4 and len(resumed) == 2
    assert resumed == pytest.approx(reference[2:], rel=1e-5)


PRICED_RUNS = [c for c in TWO_PROCESSES + FOUR_PROCESSES
               if c["strategy"].get("tensor_parallel", 1) > 1 and not {"module", "delink_at", "own_module"} & set(c)
               and CONFIGS.get(c["family"], {}).get("model_type") in PRICED_FAMILIES]
"""The tensor-parallel runs of the families `lightning-p2r plan` prices (a pseudo model's it refuses). With expert
parallelism only what each rank holds is compared: a dropless router sends each rank as many rows as it routes
there, which the planner prices at the balanced mean, so its all-to-all bytes cannot equal a rank's count."""


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", PRICED_RUNS, ids=lambda c: c["name"])
def test_the_planner_predicts_each_collective_of_a_tensor_parallel_hf_model(hf_runs: Path, config: dict) -> None:
    """Every collective a rank issued in the last step (bytes and calls, by kind), as the planner lists them from the
    family's plan and the layout alone (``planning.hf_tensor_parallel``): each projection split apart, each column
    layer's input gradient summed, the per-head norms', the experts split by expert, sequence parallelism's gathers,
    the vocabulary-parallel loss. (Counted before: seven all-reduces per Llama layer where the planner priced M6's
    four.) The parameter elements each rank holds, as the planner prices its memory (an untied embedding whole on
    every rank: the planner split it until 2026-12-01, short of a tp2 x ep2 Qwen3-MoE's data-parallel sums by a
    third). The training loss reads the logits' vocabulary shards, never the whole logits."""
    from lightning_p2r.planning import Cluster, Workload, step_transfers
    from lightning_p2r.planning.cli import layout_from_options
    from lightning_p2r.planning.hf_decoder import hf_decoder_of
    from lightning_p2r.planning.memory import stored_elements
    from lightning_p2r.planning.share import rank_share
    from lightning_p2r.planning.transfers import COLLECTIVES

    run = read_report(hf_runs, config["name"])
    devices = len(run["ranks"])
    layout = layout_from_options(config["strategy"])
    model = hf_decoder_of(CONFIGS[config["family"]])
    cluster = Cluster(devices=devices, devices_per_node=devices, accelerator="cpu")
    for rank, record in enumerate(run["ranks"]):
        pipeline_rank = rank // (devices // layout.pipeline_parallel)
        if pipeline_rank == layout.pipeline_parallel - 1:  # the stage that computes the loss
            assert record["token_loss"] == "VocabParallelCrossEntropy"
        workload = Workload(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
        transfers = step_transfers(model, layout, cluster, workload, pipeline_rank=pipeline_rank)
        # What the rank holds, as the planner prices its memory (an untied embedding whole on every rank).
        share = rank_share(model, layout, cluster, workload, pipeline_rank)
        assert record["held"] == stored_elements(model, layout, share), (config["name"], rank)
        if layout.expert_parallel > 1:
            continue
        counted = {kind: value for kind, value in record["collective_bytes"].items() if kind in COLLECTIVES}
        assert counted == bytes_by_kind(transfers, COLLECTIVES), (config["name"], rank)
        calls: dict[str, int] = {}
        for transfer in transfers:
            calls[transfer.kind] = calls.get(transfer.kind, 0) + transfer.calls
        counted_calls = {kind: value for kind, value in record["collective_calls"].items() if kind in COLLECTIVES}
        assert counted_calls == calls, (config["name"], rank)
