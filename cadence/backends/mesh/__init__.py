"""The mesh backend: FSDP2, HSDP and tensor parallel on one `DeviceMesh` (see docs/backends.md)."""

from cadence.backends.mesh.backend import MeshBackend
from cadence.backends.mesh.config import AXES, MeshConfig

__all__ = ["AXES", "MeshBackend", "MeshConfig"]
