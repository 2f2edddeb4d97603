"""A small decoder-only transformer: a Hugging Face Llama without biases.

Pre-norm blocks with RMSNorm (computed in fp32), rotary position embeddings (rotate-half layout, base
`rope_theta`), SwiGLU MLPs and causal ``scaled_dot_product_attention``, optionally with grouped-query
attention (`n_kv_heads` < `n_heads`). The byte presets keep the embedding and the output head *untied*:
with a 256-token vocabulary each is only ``256 * d_model`` parameters, so tying saves nothing worth having.
The BPE presets tie them, as the published small Llamas do, because there the embedding is a large share
of the model. A tied model has no head tensor at all (the head is the embedding's transpose), so every
parameter stays a distinct tensor for the code that flattens parameters for the outer DiLoCo step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .shape import LMShape

DEFAULT_PRESET = "tiny"


@dataclass(frozen=True)
class ModelConfig:
    """`[model]`: the transformer's shapes."""

    # byte presets tiny (0.9M parameters) | small (20.7M) | 124m | 1b; for BPE runs llama-20m | llama-150m | llama-1b
    preset: str = "tiny"
    # The vocabulary the embedding and the head are sized for: the run's tokenizer's, rounded up to a
    # multiple of 64 (set by the node that starts the run, from its dataset); 0 = the preset's own (256).
    vocab_size: int = 0
    # Run-wide: sha256 of the starting weights' model.safetensors (a Hugging Face Llama checkpoint that the
    # node starting the run read, `--init-from`); "" = the seed's random init. See dilocod/export/pininit.py.
    init: str = ""
    # Local: a Hugging Face Llama directory on this machine that holds those weights ("" = none: a peer
    # fetches them from the run into <run dir>/init).
    init_from: str = ""
    # Local: a directory on this machine holding a transformers config.json of any causal LM (GPT-2, Qwen2,
    # Mistral, Llama, …) to train instead of the preset; the node starting the run pins it (hf_config_json)
    hf_config: str = ""
    # Run-wide: that config.json as canonical JSON (sorted keys, no spaces; "" = dilocod's own model of
    # model.preset). Joiners build the model from it; see dilocod/manifest/pinhf.py
    hf_config_json: str = ""

    @property
    def is_hf(self) -> bool:
        """Whether the run trains a transformers model (its pinned config) rather than dilocod's own."""
        return bool(self.hf_config_json or self.hf_config)

    def spec(self) -> ModelSpec:
        """The preset's shapes with the run's vocabulary."""
        if self.preset not in PRESETS:
            raise ValueError(f"unknown model.preset {self.preset!r} (choose from {', '.join(PRESETS)})")
        base = PRESETS[self.preset]
        return base if self.vocab_size == 0 else dataclasses.replace(base, vocab_size=self.vocab_size)

    def validate(self) -> None:
        if isinstance(self.vocab_size, bool) or self.vocab_size < 0 or self.vocab_size % 64:
            raise ValueError(
                f"model.vocab_size must be 0 (the preset's) or a multiple of 64, got {self.vocab_size}"
            )
        if self.init and not re.fullmatch(r"[0-9a-f]{64}", self.init):
            raise ValueError(f"model.init must be a sha256 (64 hex digits) or empty, got '{self.init}'")
        if self.is_hf and self.preset != DEFAULT_PRESET:
            raise ValueError(
                f"model.hf_config and model.preset '{self.preset}' both name the model: set one of them"
            )
        if self.is_hf and (self.init or self.init_from):
            raise ValueError(
                "model.hf_config and --init-from (model.init_from) both choose the starting model: "
                "--init-from takes a Llama checkpoint of a preset; set one of them"
            )


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    max_seq_len: int
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = n_heads (none)
    tie_embeddings: bool = False  # the head is the input embedding's transpose
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.n_kv_heads == 0:  # one spelling per shape: equal specs compare equal
            object.__setattr__(self, "n_kv_heads", self.n_heads)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Rows of k (and of v) in the fused qkv projection."""
        return self.n_kv_heads * self.head_dim

    def problem(self) -> str | None:
        """Why this spec is no model (None: it is one)."""
        if self.n_heads < 1 or self.d_model % self.n_heads or self.head_dim % 2:
            return f"d_model {self.d_model} must split into {self.n_heads} heads of even size"
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            return f"{self.n_heads} heads do not split into groups of {self.n_kv_heads} key/value heads"
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            return f"rope_theta {self.rope_theta} and norm_eps {self.norm_eps} must be positive"
        return None


# Byte presets (vocabulary 256; tests, the demo): tiny 918,656 parameters; small 20,716,032; 124m
# 123,101,952; 1b 1,028,737,024 (exact, see count_params). With only 256 tokens nearly all parameters live
# in the blocks, so "124m" is deeper than GPT-2 small (16 layers, not 12) to reach the same size.
#
# BPE presets: the vocabulary is the run's tokenizer's (model.vocab_size, set when the run's dataset is
# pinned); the 32,000 here only sizes them when none is given. Totals at 32,000 tokens: llama-20m
# 21,730,176; llama-150m 124,635,456 (134,515,008 at SmolLM's 49,152); llama-1b 1,100,048,384.
# llama-150m is SmolLM-135M's shape and llama-1b TinyLlama-1.1B's (both Llama checkpoints that
# `--init-from` can start from when the run uses their tokenizer); llama-20m is a scaled-down sibling.
_BPE_VOCAB = 32000
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(vocab_size=256, d_model=128, n_layers=4, n_heads=4, ffn_hidden=384, max_seq_len=256),
    "small": ModelSpec(vocab_size=256, d_model=512, n_layers=6, n_heads=8, ffn_hidden=1536, max_seq_len=1024),
    "124m": ModelSpec(
        vocab_size=256, d_model=768, n_layers=16, n_heads=12, ffn_hidden=2304, max_seq_len=1024
    ),
    "1b": ModelSpec(vocab_size=256, d_model=2048, n_layers=20, n_heads=16, ffn_hidden=5632, max_seq_len=2048),
    "llama-20m": ModelSpec(
        vocab_size=_BPE_VOCAB, d_model=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_hidden=1024,
        max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5,
    ),
    "llama-150m": ModelSpec(
        vocab_size=_BPE_VOCAB, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden=1536,
        max_seq_len=2048, tie_embeddings=True, norm_eps=1e-5,
    ),
    "llama-1b": ModelSpec(
        vocab_size=_BPE_VOCAB, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
        max_seq_len=2048, norm_eps=1e-5,
    ),
}  # fmt: skip

ROPE_BASE = 10000.0  # the byte presets' rotary base (a spec's own is `rope_theta`)
INIT_STD = 0.02


def shape_of(spec: ModelSpec) -> LMShape:
    """The outline of dilocod's model of `spec` (an untied input embedding is only looked up)."""
    lookup = 0 if spec.tie_embeddings else spec.vocab_size * spec.d_model
    return LMShape("dilocod", spec.vocab_size, spec.max_seq_len, spec.n_layers, spec.d_model, lookup)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: under bf16 autocast the mean of squares loses too much precision.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_tables(
    seq_len: int, head_dim: int, device: torch.device, theta: float = ROPE_BASE
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim // 2] for rotary embeddings of base `theta`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels by position-dependent angles.

    x: [B, H, T, D]; cos/sin: [T, D/2].
    """
    # chunk/cat (not slicing) so the backward pass is a cheap cat instead of zero-fill + copy.
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        # Rows: q (n_heads heads), then k and v (n_kv_heads heads each), every head's rows together.
        self.qkv = nn.Linear(spec.d_model, spec.d_model + 2 * spec.kv_dim, bias=False)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((d, kv, kv), dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head h reads key/value head h // (n_heads / n_kv_heads), as HF's repeat_kv has it.
        grouped = self.n_kv_heads != self.n_heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate = nn.Linear(spec.d_model, spec.ffn_hidden, bias=False)
        self.up = nn.Linear(spec.d_model, spec.ffn_hidden, bias=False)
        self.down = nn.Linear(spec.ffn_hidden, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.d_model, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.d_model, spec.norm_eps)
        self.mlp = SwiGLU(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if (problem := spec.problem()) is not None:
            raise ValueError(problem)
        self.spec = spec
        # Recompute activations in backward to trade compute for memory on large presets.
        self.activation_checkpointing = False
        # Given its (uninitialised) weight, the embedding skips its default init: `init_weights` sets every
        # parameter anyway, and on the meta device (`lm_skeleton`, `build_model`) that init's `normal_`
        # imports torch._dynamo, about a second of every process's start-up.
        self.embed = nn.Embedding(
            spec.vocab_size, spec.d_model, _weight=torch.empty(spec.vocab_size, spec.d_model)
        )
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, spec.norm_eps)
        # Tied: no head module, so no second name for the embedding in state_dict or parameters().
        self.head = None if spec.tie_embeddings else nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        # RoPE tables are derived data, not state: kept out of state_dict (so parameters are the
        # whole state) and rebuilt lazily per (length, device).
        self._rope_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def shape(self) -> LMShape:
        return shape_of(self.spec)

    def muon_matrix(self, name: str, param: torch.Tensor) -> bool:
        """Whether Muon may train `param` (a hidden matrix of the blocks; embeddings and head take AdamW)."""
        return name.startswith("blocks.") and param.ndim == 2

    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(seq_len, self.spec.head_dim, device, self.spec.rope_theta)
        return self._rope_cache[key]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [B, T] int64 token ids -> logits [B, T, vocab_size]."""
        seq_len = idx.shape[1]
        if seq_len > self.spec.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.spec.max_seq_len}")
        cos, sin = self._rope(seq_len, idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        x = self.norm(x)
        return self.head(x) if self.head is not None else F.linear(x, self.embed.weight)


def _uniform_(tensor: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``tensor`` with a zero-mean uniform distribution of standard deviation ``std``.

    Built from integers on purpose: torch's ``normal_`` uses SIMD-dispatched log/cos whose last
    bits can differ between CPUs (AVX2 vs AVX-512 vs ARM), but Mersenne-Twister integers and
    IEEE multiply/add are identical everywhere, so every peer gets bit-identical weights.
    """
    bits = 24
    ints = torch.randint(0, 2**bits, tuple(tensor.shape), generator=gen, dtype=torch.int64)
    unit = (ints.double() + 0.5) * (2.0 / 2**bits) - 1.0  # in (-1, 1)
    with torch.no_grad():
        tensor.copy_(unit * (std * math.sqrt(3.0)))


def init_weights(model: Transformer, seed: int) -> None:
    """Deterministically initialise every parameter from ``seed`` alone (global RNG untouched)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # GPT-2 style: shrink residual-branch output projections so the residual stream's variance
    # does not grow with depth.
    residual_std = INIT_STD / math.sqrt(2 * model.spec.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            with torch.no_grad():
                param.fill_(1.0)
        elif name.endswith(("attn.out.weight", "mlp.down.weight")):
            _uniform_(param, residual_std, gen)
        else:
            _uniform_(param, INIT_STD, gen)


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """Build the preset on CPU with parameters fixed by ``seed`` (same on every machine)."""
    spec = cfg.spec()
    # Construct on the meta device: no memory, no wasted default init, no global-RNG draws.
    with torch.device("meta"):
        model = Transformer(spec)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def count_params(model: nn.Module) -> int:
    """Number of parameter elements (works on meta-device models too)."""
    return sum(p.numel() for p in model.parameters())
