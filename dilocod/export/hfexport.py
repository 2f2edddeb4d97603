"""θ_global of a `model.hf_config` run as the directory `save_pretrained` writes, and back.

The trainer's `HFCausalLM` keeps transformers' own module tree, so θ_global's tensors (in the model's
parameter order, a tied head once) are that model's parameters: written by `save_pretrained` they load with
`AutoModelForCausalLM.from_pretrained` and give the same logits. The run's tokenizer decides the special
ids: documents were separated by its EOS in training, so the exported config and generation config say
bos = eos = pad = that id, whatever the pinned config said (no other key of the architecture changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from dilocod.export.errors import ExportError
from dilocod.trainer.hfmodel import HFCausalLM, HFConfigError, build_hf_model, hf_skeleton


def check_hf_params(params: Sequence[torch.Tensor], config_json: str) -> None:
    """`params` must be the parameters of the pinned config's model, in its order (ExportError otherwise)."""
    try:
        skeleton = hf_skeleton(config_json)
    except HFConfigError as e:
        raise ExportError(str(e)) from None
    named = list(skeleton.lm.named_parameters())
    if len(params) != len(named):
        raise ExportError(f"{len(params)} tensors, but the model has {len(named)} parameters")
    for (name, ours), theirs in zip(named, params, strict=True):
        if tuple(theirs.shape) != tuple(ours.shape):
            raise ExportError(f"{name} has shape {tuple(theirs.shape)}, the model's is {tuple(ours.shape)}")


def hf_model_of(params: Sequence[torch.Tensor], config_json: str) -> HFCausalLM:
    """The pinned config's model holding `params` (fp32, CPU, eval mode)."""
    check_hf_params(params, config_json)
    model = build_hf_model(config_json, seed=0)
    with torch.no_grad():
        for param, value in zip(model.lm.parameters(), params, strict=True):
            param.copy_(value.float())
    return model.eval()


def write_hf_model(out: Path, params: Sequence[torch.Tensor], config_json: str, *, eos: int) -> None:
    """config.json, generation_config.json and model.safetensors of `params`, as `save_pretrained` lays
    them out (one safetensors file up to transformers' shard size)."""
    lm = hf_model_of(params, config_json).lm
    for cfg in (lm.config, lm.generation_config):
        cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = eos
    lm.save_pretrained(str(out), safe_serialization=True)


def load_hf_dir(model_dir: Path) -> HFCausalLM:
    """A `save_pretrained` directory of any causal LM as the trainer's model type (for `dilocod generate`)."""
    from transformers import AutoModelForCausalLM

    try:
        lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(
            f"{model_dir}: transformers cannot load it: {' '.join(str(e).split())[:300]}"
        ) from None
    return HFCausalLM(lm).eval()
