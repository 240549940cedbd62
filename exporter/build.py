"""The Python API behind `exporter build` and `exporter validate`: `from exporter.build import BuildRequest, build`.

The engine lives in `exporter.engine` (a package named `build` is skipped by ruff's and black's default excludes and by
the usual Python .gitignore); this module keeps the public import path. It imports no torch."""

from .engine import BuildRequest, build, build_targets, default_out, expand_targets, target_profile, target_refusal
from .engine import profiles, validate_build

__all__ = [
    "BuildRequest",
    "build",
    "build_targets",
    "default_out",
    "expand_targets",
    "profiles",
    "target_profile",
    "target_refusal",
    "validate_build",
]
