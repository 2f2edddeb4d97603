"""Any `transformers` causal LM as the trainer's model (`model.hf_config`): built from a config, seeded alike.

The run pins the config itself (its canonical JSON, `dilocod/manifest/pinhf.py`), so every peer builds the
same architecture without the directory it came from. `HFCausalLM` wraps the `AutoModelForCausalLM` so that
the trainer sees what dilocod's own `Transformer` offers: ``model(ids)`` returns logits (``.logits`` of the
output, no key/value cache in training), a `shape`, an `activation_checkpointing` switch and the matrices
Muon may take. The wrapped model keeps transformers' parameter names, so an export is `save_pretrained`'s
layout with nothing renamed.

Initial weights: transformers initialises with `normal_` from the global RNG, whose last bits differ between
CPUs (SIMD paths) and which other code draws from too. So after construction (inside `fork_rng`, leaving the
caller's RNG as it was) every parameter that transformers did not fill with one constant (norm weights'
ones, biases' zeros: the same on every machine) is drawn again from the run's seed with the integer-based
uniform that dilocod's own model uses, at the config's `initializer_range` (0.02 without one). Parameters
are taken in the model's own order, so the same config and seed give bit-identical θ on every peer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .model import INIT_STD, _uniform_
from .shape import LMShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

NO_MAX_LEN = 1 << 20  # a model without a position limit (none in its config) is checked against this


class HFConfigError(ValueError):
    """A transformers config that dilocod cannot train; the message is one line."""


def parse_hf_config(text: str, where: str = "model.hf_config") -> PretrainedConfig:
    """The transformers config of a config.json text; HFConfigError unless it is a causal LM's."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise HFConfigError(f"{where}: config.json is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"{where}: config.json must hold a JSON object, got {type(raw).__name__}")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HFConfigError(f"{where}: config.json names no model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFConfigError(
            f"{where}: model_type {model_type!r} is not a causal language model transformers knows "
            "(AutoModelForCausalLM has no class for it)"
        )
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise HFConfigError(
            f"{where}: transformers refuses the {model_type} config: {_one_line(e)}"
        ) from None
    # Encoders with an LM head (BERT, RoBERTa, …) and encoder-decoders are causal only as decoders.
    if getattr(config, "is_encoder_decoder", False) or (
        model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    ):
        raise HFConfigError(f"{where}: a {model_type} config is not a causal (decoder-only) language model")
    return config


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's own config (a multimodal config nests it)."""
    return config.get_text_config()


def config_vocab(config: PretrainedConfig) -> int:
    vocab = getattr(text_config(config), "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else 0


class HFCausalLM(nn.Module):
    """A transformers causal LM with the interface of dilocod's `Transformer` (see the module's docstring)."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.lm = lm
        self._checkpointing = False

    @property
    def shape(self) -> LMShape:
        cfg = text_config(self.lm.config)
        max_len = getattr(cfg, "max_position_embeddings", None)
        return LMShape(
            family=str(self.lm.config.model_type),
            vocab_size=int(cast(torch.Tensor, self.lm.get_input_embeddings().weight).shape[0]),
            max_seq_len=int(max_len) if isinstance(max_len, int) and max_len > 0 else NO_MAX_LEN,
            n_layers=int(cfg.num_hidden_layers),
            d_model=int(cfg.hidden_size),
            lookup_params=self._lookup_params(),
        )

    def _lookup_params(self) -> int:
        """Elements of the embedding tables that are only looked up (not also the output head)."""
        head = self.lm.get_output_embeddings()
        head_weight = getattr(head, "weight", None)
        tables = {id(m.weight): m.weight for m in self.lm.modules() if isinstance(m, nn.Embedding)}
        return sum(w.numel() for key, w in tables.items() if w is not head_weight)

    @property
    def activation_checkpointing(self) -> bool:
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        if on == self._checkpointing:
            return
        if on:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.lm.gradient_checkpointing_disable()
        self._checkpointing = on

    def muon_matrix(self, name: str, param: torch.Tensor) -> bool:
        """Muon takes the 2-D hidden matrices: not the embedding tables nor the output head."""
        if param.ndim != 2:
            return False
        lookups = {id(m.weight) for m in self.lm.modules() if isinstance(m, nn.Embedding)}
        head = getattr(self.lm.get_output_embeddings(), "weight", None)
        return id(param) not in lookups and param is not head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [B, T] int64 token ids -> logits [B, T, vocab_size]."""
        return self.lm(input_ids=idx, use_cache=False).logits


def _construct(config: PretrainedConfig) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    # fp32 whatever the config's dtype says (θ_global is fp32; autocast makes the bf16 copies); sdpa
    # attention, as dilocod's own model uses. Remote code is never run.
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def build_hf_model(config_json: str, seed: int) -> HFCausalLM:
    """The model of the run's pinned config on CPU, fp32, its parameters fixed by `seed` alone."""
    config = parse_hf_config(config_json)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        lm = _construct(config)
    init_hf_weights(lm, seed, float(getattr(text_config(config), "initializer_range", INIT_STD) or INIT_STD))
    return HFCausalLM(lm).train()


def init_hf_weights(lm: nn.Module, seed: int, std: float) -> None:
    """Draw again, from `seed`, every parameter transformers did not fill with a single constant."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _, param in lm.named_parameters():  # shared (tied) tensors once
        flat = param.detach().reshape(-1)
        if flat.numel() > 0 and bool((flat == flat[0]).all()):
            continue  # ones, zeros, a constant: what every machine computes alike
        _uniform_(param, std, gen)


def hf_skeleton(config_json: str) -> HFCausalLM:
    """The model on the meta device: shapes and names, no memory, no init (for shapes and counts only)."""
    config = parse_hf_config(config_json)
    with torch.device("meta"):
        return HFCausalLM(_construct(config))
