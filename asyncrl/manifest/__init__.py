"""The manifest: the YAML a run launches from, read into typed, checked values.

Owns: the schema of every section (``load``: the manifest and its roles; ``model_section``,
``pipeline_section``, ``placement``), the YAML reader with its limits (``yaml_reader``,
``limits``, ``files``, ``refs``) and the spec the supervisor hands each process (``spec``).

May import: the core (``asyncrl.errors``, ``asyncrl.role_config`` ...) and nothing else of the
runtime.
"""

from __future__ import annotations

from asyncrl.manifest.load import (
    DriverSpec,
    Manifest,
    ManifestError,
    ModelSpec,
    NetworkSpec,
    Placement,
    RoleSpec,
    RunSpec,
    SecuritySpec,
    Supervision,
    load_manifest,
    node_problems,
    parse_manifest,
    resolve_run_dir,
)

__all__ = [
    "DriverSpec",
    "Manifest",
    "ManifestError",
    "ModelSpec",
    "NetworkSpec",
    "Placement",
    "RoleSpec",
    "RunSpec",
    "SecuritySpec",
    "Supervision",
    "load_manifest",
    "node_problems",
    "parse_manifest",
    "resolve_run_dir",
]
