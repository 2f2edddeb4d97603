"""`dilocod generate`: sample text from a run's θ_global or from an exported model.

Both sources run on dilocod's own `Transformer` (an exported directory is read back with `from_llama`), so
sampling needs neither `transformers` nor its import time, and a run and its export sample alike. A
`model.hf_config` run, and an exported directory of another architecture, run on transformers' model of
their config (`HFCausalLM`), through the same loop. No
key/value cache: every new token runs the whole context (at most max_seq_len tokens) again, which is
plenty for a look at what a run has learned; use transformers' `generate` on an export for more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dilocod.data.shards import TOKENIZER_FILE
from dilocod.data.tokenizer import eos_id, load_tokenizer
from dilocod.export.errors import ExportError
from dilocod.export.export import PROVENANCE_FILE
from dilocod.export.hf import CONFIG_FILE, from_llama, read_llama_dir
from dilocod.export.hfexport import hf_model_of, load_hf_dir
from dilocod.export.run import read_run, run_tokenizer
from dilocod.trainer.lm import LanguageModel
from dilocod.trainer.model import ModelSpec, Transformer


def load_run(run_dir: Path, data_path: Path | None = None) -> tuple[LanguageModel, Tokenizer, int]:
    """θ_global of a run dir as a model, with the run's tokenizer and end-of-document id."""
    run = read_run(run_dir)
    tok, _ = run_tokenizer(run_dir, run.vocab_size, run.dataset, data_path)
    if run.model.hf_config_json:
        return hf_model_of(run.params, run.model.hf_config_json), tok, eos_id(tok)
    return _model(run.spec, run.params), tok, eos_id(tok)


def load_exported(model_dir: Path) -> tuple[LanguageModel, Tokenizer, int]:
    """An exported (or any compatible Llama) directory as our model, with its tokenizer and EOS id.
    A directory of another architecture (a `model.hf_config` run's export) loads through transformers."""
    model: LanguageModel
    if _architecture(model_dir) != "llama":
        model = load_hf_dir(model_dir)
        cfg: dict[str, Any] = model.lm.config.to_dict()
    else:
        cfg, tensors = read_llama_dir(model_dir)
        spec, params = from_llama((cfg, tensors))
        model = _model(spec, params)
    tok = load_tokenizer(model_dir / TOKENIZER_FILE)
    try:
        tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        tok_cfg = {}
    # the byte tokenizer's export marks byte 0's symbol special; texts are still read as plain bytes
    tok.encode_special_tokens = bool(tok_cfg.get("split_special_tokens", False))
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return model, tok, int(eos) if isinstance(eos, int) else eos_id(tok)


def _architecture(model_dir: Path) -> str:
    """Returns "llama" for what dilocod's own model reads (its exports, plain Llamas), else the model_type; an
    export of a `model.hf_config` run (its dilocod.json names the config) always goes to transformers."""
    try:
        provenance = json.loads((model_dir / PROVENANCE_FILE).read_text(encoding="utf-8"))
        if isinstance(provenance, dict) and provenance.get("hf_config_sha256"):
            return str(provenance.get("model_type") or "hf")
    except (OSError, ValueError):
        pass
    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "llama"  # read_llama_dir names what is wrong with it
    return str(config.get("model_type", "llama")) if isinstance(config, dict) else "llama"


def _model(spec: ModelSpec, params: list[torch.Tensor]) -> Transformer:
    model = Transformer(spec)
    model.load_state_dict(dict(zip(model.state_dict(), (p.float() for p in params))), strict=True)
    return model.eval()


def sample(
    model: LanguageModel, ids: list[int], max_new_tokens: int, *, temperature: float, top_k: int,
    seed: int, eos: int, vocab: int,
) -> list[int]:  # fmt: skip
    """Up to `max_new_tokens` new ids after `ids`, stopping at `eos`; temperature 0 is greedy.
    Only ids below `vocab` (the tokenizer's) are drawn: the rest are padding of the embedding table."""
    gen = torch.Generator().manual_seed(seed)
    context, new = list(ids), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            window = torch.tensor([context[-model.shape.max_seq_len :]], dtype=torch.long)
            logits = model(window)[0, -1, :vocab].float()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if 0 < top_k < vocab:
                    logits[logits < logits.topk(top_k).values[-1]] = -float("inf")
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            if token == eos:
                break
            context.append(token)
            new.append(token)
    return new


def generate(
    source: Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 50,
    seed: int = 0, *, data_path: Path | None = None, exported: bool | None = None,
) -> str:  # fmt: skip
    """The text sampled after `prompt` from `source`: a run dir (its θ_global) or an exported model
    directory (`exported`; None: a directory with a config.json is one)."""
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ExportError("--max-new-tokens, --temperature and --top-k must not be negative")
    source = Path(source)
    if exported or (exported is None and (source / CONFIG_FILE).is_file()):
        model, tok, eos = load_exported(source)
    else:
        model, tok, eos = load_run(source, data_path)
    # An empty prompt starts a document: in training, one began after each EOS.
    ids = tok.encode(prompt).ids or [eos]
    new = sample(
        model, ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed, eos=eos,
        vocab=min(tok.get_vocab_size(with_added_tokens=True), model.shape.vocab_size),
    )  # fmt: skip
    # Decode prompt and continuation together: a byte-level token may complete a character the prompt began.
    whole = tok.decode(ids + new, skip_special_tokens=False) if prompt else tok.decode(new)
    head = tok.decode(ids, skip_special_tokens=False) if prompt else ""
    return whole[len(head) :] if whole.startswith(head) else tok.decode(new)
