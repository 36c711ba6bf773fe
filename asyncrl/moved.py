"""Modules that moved when the runtime and the roles were split into parts, and the finder that
keeps their old import paths working.

A manifest or a program written before the move may still name ``asyncrl.roles.learner:Learner``
or import ``asyncrl.trace``. Such an import gets the module at its new path (the same module
object) and a ``FutureWarning`` that names the new path, so the old name keeps working while the
user is told where it went. ``asyncrl.manifest``, ``asyncrl.dispatch`` and ``asyncrl.weights``
are packages now, and still export the public names the old modules did.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "install"]

MOVED: dict[str, str] = {
    "asyncrl._schema": "asyncrl.manifest._schema",
    "asyncrl.accounting": "asyncrl.tools.accounting",
    "asyncrl.agent": "asyncrl.supervision.agent",
    "asyncrl.background": "asyncrl.dispatch.background",
    "asyncrl.chaos": "asyncrl.tools.chaos",
    "asyncrl.driver": "asyncrl.dispatch.driver",
    "asyncrl.faults": "asyncrl.supervision.faults",
    "asyncrl.handles": "asyncrl.dispatch.handles",
    "asyncrl.hosts": "asyncrl.supervision.hosts",
    "asyncrl.janitor": "asyncrl.supervision.janitor",
    "asyncrl.leases": "asyncrl.supervision.leases",
    "asyncrl.logs": "asyncrl.observe.logs",
    "asyncrl.manifest_files": "asyncrl.manifest.files",
    "asyncrl.manifest_limits": "asyncrl.manifest.limits",
    "asyncrl.manifest_refs": "asyncrl.manifest.refs",
    "asyncrl.manifest_yaml": "asyncrl.manifest.yaml_reader",
    "asyncrl.metrics": "asyncrl.observe.metrics",
    "asyncrl.model_section": "asyncrl.manifest.model_section",
    "asyncrl.pacing": "asyncrl.dispatch.pacing",
    "asyncrl.placement": "asyncrl.manifest.placement",
    "asyncrl.plots": "asyncrl.observe.plots",
    "asyncrl.process": "asyncrl.supervision.process",
    "asyncrl.progress": "asyncrl.observe.progress",
    "asyncrl.reduce": "asyncrl.dispatch.reduce",
    "asyncrl.roles.advantages": "asyncrl.roles.learning.advantages",
    "asyncrl.roles.algorithms": "asyncrl.roles.learning.algorithms",
    "asyncrl.roles.batching": "asyncrl.roles.learning.batching",
    "asyncrl.roles.checkpoints": "asyncrl.roles.training.checkpoints",
    "asyncrl.roles.clients": "asyncrl.roles.program.clients",
    "asyncrl.roles.critic": "asyncrl.roles.training.critic",
    "asyncrl.roles.critic_durable": "asyncrl.roles.training.critic_durable",
    "asyncrl.roles.critic_lockstep": "asyncrl.roles.training.critic_lockstep",
    "asyncrl.roles.data_parallel": "asyncrl.roles.training.data_parallel",
    "asyncrl.roles.engine": "asyncrl.roles.generation.engine",
    "asyncrl.roles.engine_bench": "asyncrl.bench.engines",
    "asyncrl.roles.engine_rows": "asyncrl.roles.generation.engine_rows",
    "asyncrl.roles.estimators": "asyncrl.roles.learning.estimators",
    "asyncrl.roles.evaluation": "asyncrl.roles.program.evaluation",
    "asyncrl.roles.groups": "asyncrl.roles.learning.groups",
    "asyncrl.roles.host_buffers": "asyncrl.roles.training.host_buffers",
    "asyncrl.roles.journal": "asyncrl.roles.training.journal",
    "asyncrl.roles.learner": "asyncrl.roles.training.learner",
    "asyncrl.roles.learner_config": "asyncrl.roles.training.learner_config",
    "asyncrl.roles.learner_durable": "asyncrl.roles.training.learner_durable",
    "asyncrl.roles.learner_export": "asyncrl.roles.training.learner_export",
    "asyncrl.roles.learner_weights": "asyncrl.roles.training.learner_weights",
    "asyncrl.roles.losses": "asyncrl.roles.learning.losses",
    "asyncrl.roles.masked": "asyncrl.roles.learning.masked",
    "asyncrl.roles.metrics": "asyncrl.roles.program.metrics",
    "asyncrl.roles.objective": "asyncrl.roles.training.objective",
    "asyncrl.roles.pipeline": "asyncrl.roles.sampling.pipeline",
    "asyncrl.roles.programs": "asyncrl.roles.program.programs",
    "asyncrl.roles.prompts": "asyncrl.roles.services.prompts",
    "asyncrl.roles.reference": "asyncrl.roles.services.reference",
    "asyncrl.roles.relay": "asyncrl.roles.services.relay",
    "asyncrl.roles.reward": "asyncrl.roles.services.reward",
    "asyncrl.roles.rollout": "asyncrl.roles.generation.rollout",
    "asyncrl.roles.sharding": "asyncrl.roles.training.sharding",
    "asyncrl.roles.vllm_engine": "asyncrl.roles.generation.vllm_engine",
    "asyncrl.roles.wal": "asyncrl.roles.training.wal",
    "asyncrl.roles.weight_sync": "asyncrl.roles.sampling.weight_sync",
    "asyncrl.rundir": "asyncrl.supervision.rundir",
    "asyncrl.runreport": "asyncrl.supervision.runreport",
    "asyncrl.scheduler": "asyncrl.dispatch.scheduler",
    "asyncrl.spec": "asyncrl.manifest.spec",
    "asyncrl.status": "asyncrl.observe.status",
    "asyncrl.store_registry": "asyncrl.supervision.store_registry",
    "asyncrl.supervisor": "asyncrl.supervision.supervisor",
    "asyncrl.trace": "asyncrl.observe.trace",
    "asyncrl.trace_nodes": "asyncrl.observe.trace_nodes",
    "asyncrl.trace_view": "asyncrl.observe.trace_view",
    "asyncrl.trace_view_graph": "asyncrl.observe.trace_view_graph",
    "asyncrl.watchdog": "asyncrl.dispatch.watchdog",
    "asyncrl.weight_layout": "asyncrl.weights.layout",
    "asyncrl.weight_reader": "asyncrl.weights.reader",
    "asyncrl.weight_store": "asyncrl.weights.store",
    "asyncrl.zygote": "asyncrl.supervision.zygote",
}
"""Old module path -> new module path."""


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}: import it (or name it in a manifest) from there",
            FutureWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import machinery set the old path's spec on the module; give it its own back.
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        """``python -m <old path>``: the new module's code, run as ``__main__``."""
        warnings.warn(
            f"{fullname} moved to {self.new}: run 'python -m {self.new}'",
            FutureWarning,
            stacklevel=2,
        )
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "get_code"):
            raise ImportError(f"{fullname} moved to {self.new}, which cannot be run with -m")
        code: types.CodeType | None = loader.get_code(self.new)
        return code


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(name)
        if new is None:
            return None
        return importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
