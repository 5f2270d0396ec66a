"""The mesh backend: FSDP2, HSDP, tensor and pipeline parallel on one `DeviceMesh` (see docs/backends.md)."""

from cadence.backends.mesh.backend import MeshBackend
from cadence.backends.mesh.config import AXES, MeshConfig
from cadence.backends.mesh.pipeline import PipelineConfig

__all__ = ["AXES", "MeshBackend", "MeshConfig", "PipelineConfig"]
