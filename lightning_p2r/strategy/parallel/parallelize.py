"""Apply tensor and expert parallelism to a model, in a fixed order, before FSDP2 shards it over the data ranks."""

from __future__ import annotations

from torch import nn

from ...layout import Layout, ModelShape
from ...layout import check_model as check_sizes
from ...models.config import M6Config
from ...models.moe import MoEFeedForward
from .experts import parallelize_experts
from .mesh import ParallelMeshes
from .tensor import apply_tensor_parallel


def moe_layers(holder: nn.Module) -> list[MoEFeedForward]:
    return [m for m in holder.blocks.modules() if isinstance(m, MoEFeedForward)]


def check_model(holder: nn.Module, meshes: ParallelMeshes, *, sequence_parallel: bool = False) -> None:
    """Refuse a model the mesh cannot split (before any parameter is placed)."""
    config = getattr(holder, "config", None)
    dims = meshes.dims
    if not isinstance(config, M6Config):
        if dims.model_parallel:
            raise ValueError(f"P2RStrategy(tensor_parallel={dims.tensor_parallel}, expert_parallel="
                             f"{dims.expert_parallel}) splits M6 models (lightning_p2r.M6Transformer); "
                             f"{type(holder).__name__} has no M6Config")
        return
    # The split degrees against the model's sizes (the pipeline's cut is checked where the stages are made).
    check_sizes(Layout(tensor_parallel=dims.tensor_parallel, expert_parallel=dims.expert_parallel,
                       sequence_parallel=sequence_parallel), ModelShape.of(config))


def parallelize_model(holder: nn.Module, meshes: ParallelMeshes, *, loss_parallel: bool = False,
                      sequence_parallel: bool = False) -> None:
    """Tensor parallelism first (``parallelize_module`` places the linear layers' weights as DTensors on the "tp"
    dimension), then the MoE layers (experts split over "ep" and "tp", tokens exchanged by all-to-all, the balance
    loss over all data ranks). FSDP2 comes after, over the data dimensions of the same meshes, as torchtitan orders
    them: it shards the already-placed DTensors further. Works on the meta device. ``loss_parallel``: the module
    computes its loss with ``loss.VocabParallelCrossEntropy`` (see ``tensor.apply_tensor_parallel``)."""
    check_model(holder, meshes, sequence_parallel=sequence_parallel)
    dims = meshes.dims
    if dims.tensor_parallel > 1:
        apply_tensor_parallel(holder, meshes.tensor, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    data_group = meshes.data_group() if dims.data_parallel > 1 else None
    for moe in moe_layers(holder):
        parallelize_experts(
            moe, expert_tensor_mesh=meshes.expert_tensor,
            expert_group=meshes.expert.get_group() if dims.expert_parallel > 1 else None,
            tp_mesh=meshes.tensor if dims.tensor_parallel > 1 else None, data_group=data_group)
