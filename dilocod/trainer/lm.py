"""Which model a run trains: dilocod's own `Transformer` of `model.preset`, or the transformers model of
the run's pinned `model.hf_config_json` (`hfmodel.py`). One place decides, for every caller that builds
the model or only needs its parameter shapes."""

from __future__ import annotations

import hashlib

import torch

from .hfmodel import HFCausalLM, build_hf_model, hf_skeleton
from .model import ModelConfig, Transformer, build_model

LanguageModel = Transformer | HFCausalLM


def build_lm(cfg: ModelConfig, seed: int) -> LanguageModel:
    """The run's model on CPU in fp32, its parameters fixed by `seed` alone (the same on every peer)."""
    if cfg.hf_config_json:
        return build_hf_model(cfg.hf_config_json, seed)
    return build_model(cfg, seed)


def lm_skeleton(cfg: ModelConfig) -> LanguageModel:
    """The run's model on the meta device: its parameters' names and shapes, no memory and no init."""
    if cfg.hf_config_json:
        return hf_skeleton(cfg.hf_config_json)
    with torch.device("meta"):
        return Transformer(cfg.spec())


def parameter_template(cfg: ModelConfig) -> list[torch.Tensor]:
    """Meta tensors of the shapes of the model's parameters, in state-dict order (the order of
    `InnerTrainer.params()` and θ_global): what needs the shapes before the model exists allocates nothing."""
    model = lm_skeleton(cfg)
    named = dict(model.named_parameters())
    return [named[name] for name in model.state_dict() if name in named]


def hf_config_sha256(config_json: str) -> str:
    """What names a pinned transformers config: the sha256 of its canonical JSON."""
    return hashlib.sha256(config_json.encode()).hexdigest()


def model_name(cfg: ModelConfig) -> str:
    """The run's model in a few words: the preset, or the transformers family and its config's hash."""
    if not cfg.hf_config_json:
        return cfg.preset
    import json

    family = json.loads(cfg.hf_config_json).get("model_type", "?")
    return f"hf {family} {hf_config_sha256(cfg.hf_config_json)[:12]}"
