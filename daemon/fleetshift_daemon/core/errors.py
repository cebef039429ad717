"""Errors of the daemon's domain core, specialised from the shared catalogue.

They stay subclasses of the shared kinds so the transport maps them without a special case.
"""

from __future__ import annotations

from fleetshift_common.errors import FailedPrecondition, InvalidArgument, NotFound


class UnknownGpuKind(NotFound):
    """A GPU kind name or NVML product name that the catalogue does not hold."""


class UnsupportedDeployment(FailedPrecondition):
    """A model/GPU/dtype/TP combination that cannot run (FP8 on A100, model does not fit ...)."""


class InvalidModelArch(InvalidArgument):
    """A model architecture (e.g. an HF config) that is incomplete or inconsistent."""


class GpuKindNotInCatalogue(UnknownGpuKind, KeyError):
    """A catalogue lookup miss; also a KeyError, as a mapping lookup would raise."""
