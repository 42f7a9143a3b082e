"""The worker configurations of the model-parallel tests (tensor / expert: test_parallel.py; pipeline:
test_pipeline.py), run by one set of launches (see conftest.py): starting the processes is most of the cost."""

PSEUDO = {"num_layers": 4, "num_unique_blocks": 1, "moe_layers": [0, 1, 2, 3]}
SHALLOW = PSEUDO | {"sharing": "cycle", "pseudo_depth": "shallow"}  # one layer, grown to 4 (issue 30)
# ... with experts sharing one FFN until the growth upcycles them; dropless and without the balance loss, which a
# shared FFN (not split, so not yet balanced over the data ranks) computes from each rank's own tokens.
SHALLOW_SHARED = SHALLOW | {"num_unique_experts": 1, "upcycle_noise": 0.01, "capacity_factor": None,
                            "router_aux_loss_coef": 0.0}

ONE_PROCESS = [
    {"name": "reference", "save": "one_process.ckpt", "validate": True},
    {"name": "reference_4_steps", "steps": 4},
    {"name": "reference_delink", "model": PSEUDO, "delink_at": 2, "steps": 4},
    {"name": "reference_layered_m2", "strategy": {"accumulation": "layered", "micro_batches": 2}},
    {"name": "reference_delink_5_steps", "model": PSEUDO, "delink_at": 2, "steps": 5},
    {"name": "reference_grown", "model": SHALLOW, "delink_at": 2, "steps": 4},
    {"name": "reference_grown_upcycled", "model": SHALLOW_SHARED, "delink_at": 2, "steps": 4},
]
TWO_PROCESSES = [
    {"name": "tp2", "strategy": {"tensor_parallel": 2}, "validate": True},
    {"name": "tp2_layered_m2", "strategy": {"tensor_parallel": 2, "accumulation": "layered", "micro_batches": 2}},
    {"name": "tp2_sequence_parallel", "strategy": {"tensor_parallel": 2, "sequence_parallel": True},
     "validate": True},
    {"name": "ep2", "strategy": {"expert_parallel": 2}},
    {"name": "tp2_zero3", "strategy": {"tensor_parallel": 2, "sharding": "zero3"}},
    {"name": "ep2_zero3_offload", "strategy": {"expert_parallel": 2, "sharding": "zero3", "offload_fraction": 0.5}},
    {"name": "tp2_delink", "model": PSEUDO, "delink_at": 2, "steps": 4, "strategy": {"tensor_parallel": 2}},
    {"name": "tp2_grown", "model": SHALLOW, "delink_at": 2, "steps": 4, "strategy": {"tensor_parallel": 2}},
    {"name": "ep2_grown_upcycled", "model": SHALLOW_SHARED, "delink_at": 2, "steps": 4,
     "strategy": {"expert_parallel": 2}},
    {"name": "ep2_zero2_layered_m2", "strategy": {"expert_parallel": 2, "sharding": "zero2",
                                                  "accumulation": "layered", "micro_batches": 2}},
    {"name": "ep2_forgets_gradient_scale", "strategy": {"expert_parallel": 2}, "forget_expert_gradient_scale": True},
    # Recompute runs each layer's forward twice, and its collectives with it (the planner's counts follow).
    {"name": "ep2_zero2_layered_m2_recompute", "strategy": {"expert_parallel": 2, "sharding": "zero2",
                                                            "accumulation": "layered", "micro_batches": 2,
                                                            "recompute": True}},
    {"name": "tp2_sequence_parallel_layered_m2_recompute", "strategy": {
        "tensor_parallel": 2, "sequence_parallel": True, "accumulation": "layered", "micro_batches": 2,
        "recompute": True}},
]
FOUR_PROCESSES = [
    {"name": "tp2_ep2_zero3", "strategy": {"tensor_parallel": 2, "expert_parallel": 2, "sharding": "zero3"},
     "save": "tp2_ep2.ckpt", "validate": True},
    {"name": "ep2_zero2_on_4", "strategy": {"expert_parallel": 2, "sharding": "zero2"}},
    {"name": "tp2_zero1_on_4", "strategy": {"tensor_parallel": 2, "sharding": "zero1"}, "delink_at": 2, "steps": 4,
     "model": PSEUDO},
    {"name": "tp2_ep2_sequence_parallel_zero3_layered", "strategy": {
        "tensor_parallel": 2, "expert_parallel": 2, "sequence_parallel": True, "sharding": "zero3",
        "accumulation": "layered", "micro_batches": 2}},
    {"name": "tp2_ep2_delink_offload", "model": PSEUDO, "delink_at": 2, "steps": 4,
     "strategy": {"tensor_parallel": 2, "expert_parallel": 2, "offload_fraction": 0.5}},
    {"name": "tp2_ep2_resumes_one_process", "steps": 4, "resume": "one_process.ckpt",
     "strategy": {"tensor_parallel": 2, "expert_parallel": 2}},
    {"name": "ep2_zero1_on_4", "strategy": {"expert_parallel": 2, "sharding": "zero1"}, "delink_at": 2, "steps": 4,
     "model": PSEUDO, "save": "ep2_zero1.ckpt"},
    {"name": "ep2_zero1_resumes_one_process", "steps": 4, "resume": "one_process.ckpt",
     "strategy": {"expert_parallel": 2, "sharding": "zero1"}},
]
RESUME = [{"name": "one_process_resumes_tp2_ep2", "steps": 4, "resume": "tp2_ep2.ckpt"},
          {"name": "one_process_resumes_ep2_zero1", "model": PSEUDO, "delink_at": 2, "steps": 5,
           "resume": "ep2_zero1.ckpt"}]

REFERENCE_OF = {"tp2_delink": "reference_delink", "tp2_grown": "reference_grown",
                "ep2_grown_upcycled": "reference_grown_upcycled", "tp2_zero1_on_4": "reference_delink",
                "ep2_zero1_on_4": "reference_delink",
                "tp2_ep2_delink_offload": "reference_delink",
                "ep2_zero2_layered_m2": "reference_layered_m2", "tp2_layered_m2": "reference_layered_m2",
                "tp2_ep2_sequence_parallel_zero3_layered": "reference_layered_m2",
                "ep2_zero2_layered_m2_recompute": "reference_layered_m2",
                "tp2_sequence_parallel_layered_m2_recompute": "reference_layered_m2"}

# Pipeline parallelism: 4 layers (2 stages of 2, or 4 stages of 1 looped over 2 ranks), MoE in every layer, and
# micro-batches. The references run layered accumulation with the same micro-batches on one process, so the balance
# loss (computed per micro-batch, and not linear in the tokens) is the same objective; the 4-process run splits the
# batch over 2 data ranks too, so its micro-batches are half as large: its model has no balance loss.
PIPELINE_MODEL = {"num_layers": 4, "moe_layers": [0, 1, 2, 3]}
PIPELINE_PSEUDO = PIPELINE_MODEL | {"num_unique_blocks": 1}
PIPELINE_NO_BALANCE = PIPELINE_MODEL | {"router_aux_loss_coef": 0.0}
LAYERED_M2 = {"accumulation": "layered", "micro_batches": 2}
PP2 = {"pipeline_parallel": 2, "micro_batches": 2}

PIPELINE_ONE_PROCESS = [
    {"name": "pp_reference", "model": PIPELINE_MODEL, "steps": 4, "validate": True, "strategy": LAYERED_M2},
    {"name": "pp_reference_delink", "model": PIPELINE_PSEUDO, "delink_at": 2, "steps": 4, "strategy": LAYERED_M2},
    {"name": "pp_reference_no_balance", "model": PIPELINE_NO_BALANCE, "steps": 4, "validate": True,
     "strategy": LAYERED_M2},
    {"name": "pp_reference_saved", "model": PIPELINE_NO_BALANCE, "steps": 2, "save": "pp_one_process.ckpt",
     "strategy": LAYERED_M2 | {"sharding": "zero2"}},
]
PIPELINE_TWO_PROCESSES = [
    {"name": "pp2_gpipe", "model": PIPELINE_MODEL, "strategy": PP2 | {"pipeline_schedule": "gpipe"}},
    {"name": "pp2_1f1b_recompute", "model": PIPELINE_MODEL, "strategy": PP2 | {"recompute": True}},
    {"name": "pp2_1f1b", "model": PIPELINE_MODEL, "steps": 4, "validate": True, "strategy": PP2},
    {"name": "pp2_interleaved_1f1b_v2", "model": PIPELINE_MODEL,
     "strategy": PP2 | {"pipeline_schedule": "interleaved_1f1b", "stages_per_rank": 2}},
    {"name": "pp2_looped_bfs_v2_zero3_offload", "model": PIPELINE_MODEL,
     "strategy": PP2 | {"pipeline_schedule": "looped_bfs", "stages_per_rank": 2, "sharding": "zero3",
                        "offload_fraction": 0.5, "accumulation": "layered"}},
    {"name": "pp2_delink", "model": PIPELINE_PSEUDO, "delink_at": 2, "steps": 4, "strategy": PP2},
    # ZeRO-1 with a stage alone on its rank: plain stage modules (no FSDP2) and the plain optimizer (a one-rank group).
    {"name": "pp2_zero1", "model": PIPELINE_MODEL, "strategy": PP2 | {"sharding": "zero1"}},
    {"name": "pp2_pseudo_forgets_replica_sum", "model": PIPELINE_PSEUDO, "steps": 2, "strategy": PP2,
     "forget_replica_sum": True},
    {"name": "pp2_saved", "model": PIPELINE_MODEL, "steps": 2, "save": "pp2.ckpt", "strategy": PP2 | {
        "sharding": "zero2"}},
    {"name": "pp2_resumes_pp2", "model": PIPELINE_MODEL, "steps": 4, "resume": "pp2.ckpt", "strategy": PP2},
]
PIPELINE_FOUR_PROCESSES = [
    {"name": "pp2_looped_bfs_zero3_on_4", "model": PIPELINE_NO_BALANCE, "steps": 4, "validate": True,
     "strategy": PP2 | {"sharding": "zero3", "pipeline_schedule": "looped_bfs", "stages_per_rank": 2}},
    {"name": "pp2_zero3_resumes_one_process", "model": PIPELINE_NO_BALANCE, "steps": 4,
     "resume": "pp_one_process.ckpt", "strategy": PP2 | {"sharding": "zero3"}},
    {"name": "pp2_zero1_on_4", "model": PIPELINE_NO_BALANCE, "strategy": PP2 | {"sharding": "zero1"}},
    {"name": "pp2_tp2", "model": PIPELINE_MODEL, "steps": 4, "validate": True, "strategy": PP2 | {
        "tensor_parallel": 2}},
    {"name": "pp2_ep2_zero2", "model": PIPELINE_MODEL, "strategy": PP2 | {"expert_parallel": 2, "sharding": "zero2"}},
    {"name": "pp2_tp2_sequence_parallel_delink", "model": PIPELINE_PSEUDO, "delink_at": 2, "steps": 4,
     "strategy": PP2 | {"tensor_parallel": 2, "sequence_parallel": True}},
]
PIPELINE_RESUME = [{"name": "one_process_resumes_pp2", "model": PIPELINE_MODEL, "steps": 4, "resume": "pp2.ckpt",
                    "strategy": LAYERED_M2}]
PIPELINE_REFERENCE_OF = {"pp2_delink": "pp_reference_delink", "pp2_looped_bfs_zero3_on_4": "pp_reference_no_balance",
                         "pp2_zero1_on_4": "pp_reference_no_balance",
                         "pp2_tp2_sequence_parallel_delink": "pp_reference_delink"}

# Compiled twins (P2RStrategy(compile=...)) of a representative subset, each compared with its eager twin above:
# tensor and sequence parallelism (rotary positions: the first block reads the embedding's all-reduce), expert
# parallelism (its all-to-alls are graph breaks) with ZeRO-3 and offload, delinking under tensor parallelism, a
# pipeline schedule with recompute, looped stages with layered accumulation, ZeRO-3 and offload, and DDP with ZeRO-1
# (the ddp engine) delinked. Compiled with aot_eager, counted (tests/unit/compiled_runs.py): the same dynamo graphs
# through AOTAutograd as inductor, without its code generation (a minute per layout on 2 cores);
# tests/unit/test_compile.py compiles with inductor. About 6 s per compiled run here: the subset keeps the suite's
# share under a minute (every configuration of the lists above, compiled, matched its eager run once: commit
# "P2RStrategy(compile=...): benchmark ...").
COMPILE_BACKEND = "p2r_counted_aot_eager"
DDP_ZERO1_DELINK = {"name": "ddp_zero1_delink", "model": PSEUDO, "delink_at": 2, "steps": 4,
                    "strategy": {"sharding": "zero1"}}


def compiled_twin(config: dict) -> dict:
    return config | {"name": f"{config['name']}_compiled",
                     "strategy": config.get("strategy", {}) | {"compile": COMPILE_BACKEND}}


COMPILED_SUBSET = ("tp2_sequence_parallel", "ep2_zero3_offload", "tp2_delink", "pp2_1f1b_recompute",
                   "pp2_looped_bfs_v2_zero3_offload")
_TWINNED = [DDP_ZERO1_DELINK] + [c for c in TWO_PROCESSES + PIPELINE_TWO_PROCESSES if c["name"] in COMPILED_SUBSET]
COMPILE_TWO_PROCESSES = [DDP_ZERO1_DELINK] + [compiled_twin(c) for c in _TWINNED]
EAGER_TWIN = {compiled_twin(c)["name"]: c["name"] for c in _TWINNED}
