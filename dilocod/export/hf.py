"""Our transformer as a Hugging Face Llama checkpoint, and back.

`dilocod.trainer.model` is a Llama without biases: pre-norm RMSNorm (the spec's eps, in fp32), rotary
embeddings of base `rope_theta` in the rotate-half layout (a head's channel i pairs with channel
i + head_dim/2, exactly as `transformers`' `rotate_half`), a SwiGLU MLP, grouped-query attention when
`n_kv_heads < n_heads`, and a tied or untied head. So the mapping is renames plus one split: our fused `qkv`
rows are q (`n_heads x head_dim`), k and v (`n_kv_heads x head_dim` each) in that order, head-major as HF's
projections are, cut into `q_proj`, `k_proj`, `v_proj`. No row permutation is needed (the permutation some
converters apply is for Meta's interleaved-pair layout, which neither side uses); tests/test_export.py
checks the logits agree. A tied model writes no `lm_head.weight`, as `transformers` saves one.

`to_llama` and `from_llama` are exact inverses (no dtype change, no arithmetic): import then export gives
the same bytes. Importing `transformers` is slow, so only `to_llama` (which builds a `LlamaConfig`) does;
`from_llama` reads config.json as plain JSON, so sampling from an exported model does not pay for it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dilocod.export.errors import ExportError
from dilocod.trainer.model import PRESETS, ModelSpec, Transformer

if TYPE_CHECKING:
    from transformers import LlamaConfig

ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint (import only)

Params = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]


def state_dict_names(spec: ModelSpec) -> list[str]:
    """Our parameter names in `state_dict` order: the order of θ_global's tensors in a checkpoint."""
    with torch.device("meta"):
        return list(Transformer(spec).state_dict())


def _moved(spec: ModelSpec) -> list[tuple[str, str]]:
    """(ours, HF's) for every tensor that only changes its name."""
    pairs = [("embed.weight", "model.embed_tokens.weight")]
    for n in range(spec.n_layers):
        ours, hf = f"blocks.{n}.", f"model.layers.{n}."
        pairs += [
            (ours + "attn_norm.weight", hf + "input_layernorm.weight"),
            (ours + "attn.out.weight", hf + "self_attn.o_proj.weight"),
            (ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight"),
            (ours + "mlp.gate.weight", hf + "mlp.gate_proj.weight"),
            (ours + "mlp.up.weight", hf + "mlp.up_proj.weight"),
            (ours + "mlp.down.weight", hf + "mlp.down_proj.weight"),
        ]
    pairs.append(("norm.weight", "model.norm.weight"))
    return pairs if spec.tie_embeddings else [*pairs, ("head.weight", "lm_head.weight")]


def _qkv_rows(spec: ModelSpec) -> list[int]:
    """Rows of q, k and v in our fused qkv."""
    return [spec.d_model, spec.kv_dim, spec.kv_dim]


def _split(spec: ModelSpec) -> list[tuple[str, list[str]]]:
    """(our fused qkv, HF's q, k and v projections, in the order qkv's rows hold them) per layer."""
    layers = range(spec.n_layers)
    return [
        (f"blocks.{n}.attn.qkv.weight", [f"model.layers.{n}.self_attn.{p}_proj.weight" for p in "qkv"])
        for n in layers
    ]


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Transformer(spec).state_dict().items()}


def named_params(params: Params, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """`params` by our names, each checked against the spec's shape."""
    shapes = _shapes(spec)
    if isinstance(params, Mapping):
        named = dict(params)
    else:
        if len(params) != len(shapes):
            raise ExportError(f"{len(params)} tensors, but the model has {len(shapes)} parameters")
        named = dict(zip(shapes, params))
    if set(named) != set(shapes):
        odd = sorted(set(named) ^ set(shapes))
        raise ExportError(f"parameter names do not match the model's: {', '.join(odd[:4])}")
    for name, shape in shapes.items():
        if tuple(named[name].shape) != shape:
            raise ExportError(f"{name} has shape {tuple(named[name].shape)}, the model's is {shape}")
    return named


def llama_config_dict(
    spec: ModelSpec, *, bos_id: int | None = None, eos_id: int | None = None
) -> dict[str, Any]:
    """The `LlamaConfig` fields that make HF's Llama compute what our model does."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": "float32",
    }


def llama_tensors(params: Params, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Our parameters (by name, or a list in state_dict order) under HF Llama's names."""
    named = named_params(params, spec)
    tensors = {hf: named[ours].detach().contiguous() for ours, hf in _moved(spec)}
    for ours, projections in _split(spec):
        # clone: safetensors refuses tensors that share storage, and chunks are views of qkv
        for hf, part in zip(projections, named[ours].detach().split(_qkv_rows(spec), dim=0)):
            tensors[hf] = part.clone()
    return tensors


def to_llama(
    params: Params, spec: ModelSpec, *, bos_id: int | None = None, eos_id: int | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A `LlamaConfig` and HF-named tensors (same dtype, same values) for our model's parameters."""
    from transformers import LlamaConfig

    tensors = llama_tensors(params, spec)
    return LlamaConfig(**llama_config_dict(spec, bos_id=bos_id, eos_id=eos_id)), tensors


# ---------------------------------------------------------------- import


def _rope_theta(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """(theta, rope type) from a config of transformers 5 (`rope_parameters`) or 4 (`rope_theta`)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))  # LlamaConfig's default base
    return theta, rope.get("rope_type", rope.get("type", "default"))


def _refusal(cfg: Mapping[str, Any]) -> str | None:
    """Why `cfg` describes a model ours cannot be (None: it can)."""
    if cfg.get("model_type") != "llama":
        return f"not a Llama model (model_type {cfg.get('model_type')!r})"
    architectures = cfg.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        return f"not a Llama causal LM (architectures {', '.join(map(str, architectures))})"
    checks = [("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1)]
    for key, ours in checks:
        if cfg.get(key, ours) not in (ours, None):
            return f"{key} is {cfg.get(key)!r}; dilocod's model has {ours!r}"
    _, rope_type = _rope_theta(cfg)
    if rope_type != "default":
        return f"rotary embeddings of type {rope_type!r}; dilocod's are the default (unscaled) ones"
    return None


def spec_of_config(cfg: Mapping[str, Any], where: str = "the Llama config") -> ModelSpec:
    """The `ModelSpec` a Llama config describes; ExportError (one line) for one ours cannot be."""
    problem = _refusal(cfg)
    if problem is not None:
        raise ExportError(f"{where}: {problem}")
    try:
        spec = ModelSpec(
            vocab_size=int(cfg["vocab_size"]), d_model=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]), n_heads=int(cfg["num_attention_heads"]),
            ffn_hidden=int(cfg["intermediate_size"]), max_seq_len=int(cfg["max_position_embeddings"]),
            n_kv_heads=int(cfg.get("num_key_value_heads") or 0),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),  # LlamaConfig's default
            rope_theta=float(_rope_theta(cfg)[0]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: missing or malformed field {e}") from None
    head_dim = cfg.get("head_dim") or spec.head_dim
    if spec.n_heads < 1 or spec.d_model % spec.n_heads or head_dim != spec.head_dim or head_dim % 2:
        raise ExportError(f"{where}: {spec.n_heads} heads of size {head_dim} do not make {spec.d_model}")
    if (problem := spec.problem()) is not None:
        raise ExportError(f"{where}: {problem}")
    return spec


def matching_preset(spec: ModelSpec) -> str | None:
    """The preset `spec` is, its vocabulary aside (None: none is)."""
    for name, preset in PRESETS.items():
        if dataclasses.replace(spec, vocab_size=preset.vocab_size) == preset:
            return name
    return None


def from_llama(source: Path | tuple[Any, Mapping[str, torch.Tensor]]) -> tuple[ModelSpec, list[torch.Tensor]]:
    """The spec and our parameters (state_dict order, dtype as stored) of an HF Llama: a directory with
    config.json and model.safetensors, or (a LlamaConfig or its dict, HF-named tensors)."""
    cfg: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]
    if isinstance(source, (str, Path)):
        cfg, tensors = read_llama_dir(Path(source))
        where = str(Path(source) / CONFIG_FILE)
    else:
        config, tensors = source
        cfg = config if isinstance(config, Mapping) else config.to_dict()
        where = "the Llama config"
    spec = spec_of_config(cfg, where)
    tensors = _untied_copy_dropped(tensors, spec, where)
    _check_llama_shapes(tensors, spec, where)
    named = {ours: tensors[hf] for ours, hf in _moved(spec)}
    for ours, projections in _split(spec):
        named[ours] = torch.cat([tensors[hf] for hf in projections], dim=0)
    return spec, [named[name] for name in state_dict_names(spec)]


def _untied_copy_dropped(
    tensors: Mapping[str, torch.Tensor], spec: ModelSpec, where: str
) -> Mapping[str, torch.Tensor]:
    """A tied checkpoint may still store `lm_head.weight` (some savers write both names): it must be the
    embedding's copy, and is then dropped, since our tied model has no head of its own."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if not spec.tie_embeddings or head is None:
        return tensors
    if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
        raise ExportError(f"the weights do not fit {where}: tied embeddings, but lm_head.weight differs")
    return {name: t for name, t in tensors.items() if name != "lm_head.weight"}


def _check_llama_shapes(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, where: str) -> None:
    """Exactly the tensors of `spec`'s Llama, each of its shape."""
    ours = _shapes(spec)
    expected = {hf: ours[name] for name, hf in _moved(spec)}
    for _, projections in _split(spec):
        expected.update({hf: (rows, spec.d_model) for hf, rows in zip(projections, _qkv_rows(spec))})
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise ExportError(f"the weights do not fit {where}: {detail}")
    for hf, shape in expected.items():
        if tuple(tensors[hf].shape) != shape:
            raise ExportError(
                f"the weights do not fit {where}: {hf} is {tuple(tensors[hf].shape)}, not {shape}"
            )


def read_llama_dir(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json (as a dict) and every tensor of model.safetensors (or of its shards)."""
    return read_config(path), _read_weights(path)


def read_config(path: Path) -> dict[str, Any]:
    """config.json of the model directory `path`, as a dict."""
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path}: no {CONFIG_FILE} (not a Hugging Face model directory)") from None
    except (OSError, ValueError) as e:
        raise ExportError(f"{path / CONFIG_FILE}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{path / CONFIG_FILE}: not a JSON object")
    return cfg


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS_FILE).exists():
        return load_safetensors(path / WEIGHTS_FILE)
    if not (path / WEIGHTS_INDEX).exists():
        raise ExportError(f"{path}: no {WEIGHTS_FILE} (only safetensors checkpoints are read)")
    try:
        shards = sorted(set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{path / WEIGHTS_INDEX}: unreadable ({e})") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_safetensors(path / shard))
    return tensors


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as e:  # the library raises its own SafetensorError, OSError, or a bare Exception
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportError(f"{path}: not a readable safetensors file ({detail})") from None
