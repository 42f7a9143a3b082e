"""Tensor and expert parallelism on a device mesh, applied to a block-sequence model from outside (see
``parallelize.py`` for the order, ``mesh.py`` for the ranks, ``tensor.py`` and ``experts.py`` for the layers)."""

from .mesh import ParallelMeshes, build_meshes
from .parallelize import parallelize_model

__all__ = ["ParallelMeshes", "build_meshes", "parallelize_model"]
