"""What a model-parallel run moves, measured and predicted: the data-parallel parts of the placed parameters, and
the traffic formulas' bytes per collective kind for one rank (the parallel benchmark and its test compare them)."""

from __future__ import annotations

from typing import Any

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def data_parallel_parts(module: Any) -> tuple[int, int]:
    """Bytes of the parameters' tensor / expert-parallel parts that more than one data rank holds: (in blocks,
    outside blocks). Read from each DTensor's mesh: its "tp" and "ep" dimensions split it, the others are data."""
    from torch.distributed.tensor import DTensor, Shard

    block_bytes = root_bytes = 0
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh, split, holders = param.device_mesh, 1, 1
        for dim_name, placement in zip(mesh.mesh_dim_names, param.placements):
            size = mesh[dim_name].size()
            if dim_name in ("tp", "ep"):
                split *= size if isinstance(placement, Shard) else 1
            else:
                holders *= size
        if holders > 1:
            part = param.numel() // split * param.element_size()
            if ".blocks." in f".{name}":
                block_bytes += part
            else:
                root_bytes += part
    return block_bytes, root_bytes


def predicted_bytes(model: dict[str, Any], strategy: dict[str, Any], devices: int, global_batch: int,
                    report: dict[str, Any], *, clipping: bool = False, gloo: bool = False) -> dict[str, float]:
    """The formulas' bytes per kind for one rank (the mean over the ranks, as the table compares them); empty for
    layouts without tensor or expert parallelism. ``clipping``: the run clips gradients by norm; ``gloo``: it ran on
    gloo (CPU processes), which gathers the balance loss's small sums."""
    from lightning_p2r.layout import ParallelDims
    from lightning_p2r.planning.traffic import (
        StepShape,
        balance_loss_bytes,
        clipping_bytes,
        data_parallel_bytes,
        expert_parallel_bytes,
        tensor_parallel_bytes,
    )

    dims = ParallelDims(devices, strategy.get("tensor_parallel", 1), strategy.get("expert_parallel", 1))
    if not dims.model_parallel:
        return {}
    shape = StepShape(tokens=global_batch // dims.data_parallel * model["max_seq_len"], dim=model["dim"],
                      vocab_size=model["vocab_size"], num_layers=model["num_layers"],
                      moe_layers=len(model["moe_layers"]), num_experts=model["num_experts"],
                      assignments_per_token=model["num_prototypes"] * model["moe_top_k"])
    predicted = dict.fromkeys(KINDS, 0.0)
    sequence_parallel = strategy.get("sequence_parallel", False)
    parts = (tensor_parallel_bytes(shape, dims.tensor_parallel, sequence_parallel=sequence_parallel),
             expert_parallel_bytes(shape, dims.expert_parallel),
             balance_loss_bytes(shape, dims.data_parallel, gloo=gloo), clipping_bytes(clipping),
             data_parallel_bytes(report["fsdp_mode"], block_bytes=report["block_bytes"],
                                 root_bytes=report["root_bytes"]))
    for part in parts:
        for kind, value in part.items():
            predicted[kind] += value
    return predicted
