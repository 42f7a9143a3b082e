"""The two device meshes of a tensor / expert / pipeline parallel job over the same ranks (``layout.ParallelDims``):
the dense mesh ``(pp, data..., "tp")`` and the expert mesh ``(pp, expert data..., "ep", "tp")``. A parameter's FSDP2
and model-parallel placements must come from one mesh, and the dense weights and the experts are sharded over
different data dimensions: hence two meshes rather than one with flattened dimensions (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...layout import ParallelDims


@dataclass
class ParallelMeshes:
    """The dense and expert meshes of one job (see the module docstring), and the sub-meshes the engine uses."""

    dims: ParallelDims
    dense: Any
    experts: Any
    """None without tensor or expert parallelism."""
    data_dims: tuple[str, ...]
    """The dense mesh's data dimensions, as FSDP2 takes them: ("replicate", "shard") or ("shard",)."""
    expert_data_dims: tuple[str, ...]
    """Where FSDP2 lays out the experts: the ranks holding the same experts."""

    @property
    def tensor(self) -> Any:
        return self.dense["tp"]

    @property
    def data(self) -> Any:
        """Where FSDP2 lays out the dense parameters."""
        return self.dense[self.data_dims]

    def data_group(self) -> Any:
        """The process group of every rank that sees a different batch (expert ranks included)."""
        return self.data_dims_group(self.dense, self.data_dims)

    @staticmethod
    def data_dims_group(mesh: Any, names: tuple[str, ...]) -> Any:
        # FSDP2's replicate layout has a second data dimension of size 1: its group is the first one.
        sized = [name for name in names if mesh[name].size() > 1] or [names[0]]
        return mesh[sized[0]].get_group()


def build_meshes(dims: ParallelDims, device_type: str, *, replicate: bool) -> ParallelMeshes:
    """The two meshes of ``dims``. ``replicate``: FSDP2's replicate layout (sharding "none" and "zero1"), else
    parameters sharded over the data ranks. A data dimension of one rank is a size-1 shard dimension either way (a
    replicate dimension of one rank would all-reduce every gradient with itself)."""
    from torch.distributed.device_mesh import init_device_mesh

    # Pipeline stages, when there are several, are the outermost dimension of both meshes.
    outer = {"pp": dims.pipeline_parallel} if dims.pipeline_parallel > 1 else {}

    def mesh(ranks: int, prefix: str, inner: dict[str, int]) -> tuple[Any, tuple[str, ...]]:
        """A mesh (outer, data..., inner) over ``ranks`` data ranks, and the names of its data dimensions."""
        hsdp = replicate and ranks > 1
        data = {f"{prefix}replicate": ranks, f"{prefix}shard": 1} if hsdp else {f"{prefix}shard": ranks}
        sizes = outer | data | inner
        return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes)), tuple(data)

    dense, data_dims = mesh(dims.data_parallel, "", {"tp": dims.tensor_parallel})
    if not dims.model_parallel:  # data parallelism alone: nothing is split, no expert mesh (or its groups)
        return ParallelMeshes(dims, dense, None, data_dims, ())
    experts, expert_data_dims = mesh(dims.expert_data_parallel, "expert_",
                                     {"ep": dims.expert_parallel, "tp": dims.tensor_parallel})
    return ParallelMeshes(dims, dense, experts, data_dims, expert_data_dims)
