"""The learner's model: built from a local path or a config (never downloaded), and its class
imported ahead of the build (``Learner.preload``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["build_model", "preload_model_class"]


def build_model(model_path: str, model_config: dict[str, Any], seed: int) -> Any:
    """A causal LM from a local path, or built from a config (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # its class methods are untyped
    if model_path:
        return auto.from_pretrained(model_path)
    if not model_config:
        raise ValueError("learner: set model_path or model_config")
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**model_config)
    return auto.from_config(config)


def preload_model_class(config: Mapping[str, Any]) -> None:
    """Import the model's class named by a learner's ``config`` (its module, and transformers'
    modeling code with it), without building it: most of a first build's time, 1.5 s of 1.5 s
    on the main job. A config it cannot read is left for setup to report."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path, model_config = config.get("model_path"), config.get("model_config")
    try:
        if path:
            found = AutoConfig.from_pretrained(path, local_files_only=True)
        elif isinstance(model_config, Mapping) and model_config:
            found = AutoConfig.for_model(**model_config)
        else:
            return
        AutoModelForCausalLM._model_mapping[type(found)]  # imports the class's module
    except Exception:  # setup meets the problem again, and reports it
        return
