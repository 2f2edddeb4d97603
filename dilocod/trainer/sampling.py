"""What θ_global has learnt, in words: a peer's greedy completion of the run's fixed prompt.

Every `trainer.sample_every` outer rounds, right after the evaluation of the new θ_global, a peer completes
`trainer.sample_prompt` (run-wide: every peer completes the same text) with up to `trainer.sample_tokens`
greedy tokens and puts the text in its status record; the bootstrap's dashboard shows the newest. Greedy, so
peers that hold the same θ_global write the same text. No key/value cache: each new token runs the whole
(short) context again, a few forward passes of a few dozen tokens, cheaper than one inner step of a batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dilocod.trainer.lm import LanguageModel

if TYPE_CHECKING:  # the trainer imports torch (and the data package for its corpus) only
    from tokenizers import Tokenizer

log = logging.getLogger("dilocod.trainer")

MAX_CHARS = 200  # of a completion in a status record (the record has a size limit)
TOKENIZER_FILE = "tokenizer.json"  # dilocod.data.shards.TOKENIZER_FILE
BYTE_VOCAB = 256


class Sampler:
    """Completes one prompt from a model (call it in the trainer thread: it runs the model)."""

    def __init__(self, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, eos: int) -> None:
        self.tokenizer, self.prompt, self.max_new_tokens, self.eos = tokenizer, prompt, max_new_tokens, eos
        self.ids = tokenizer.encode(prompt).ids or [eos]  # an empty prompt starts a document
        self.vocab = tokenizer.get_vocab_size(with_added_tokens=True)

    @torch.inference_mode()
    def __call__(self, model: LanguageModel) -> str:
        was_training = model.training
        model.eval()
        try:
            new = self._greedy(model)
        finally:
            model.train(was_training)
        # Prompt and completion decoded together: a byte-level token may finish a character the prompt began.
        head = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        whole = self.tokenizer.decode(self.ids + new, skip_special_tokens=False)
        text = whole[len(head) :] if self.prompt and whole.startswith(head) else self.tokenizer.decode(new)
        return text[:MAX_CHARS]

    def _greedy(self, model: LanguageModel) -> list[int]:
        device = next(model.parameters()).device
        context, new = list(self.ids), []
        vocab = min(self.vocab, model.shape.vocab_size)  # the rest of the embedding table is padding
        for _ in range(self.max_new_tokens):
            window = torch.tensor([context[-model.shape.max_seq_len :]], dtype=torch.long, device=device)
            token = int(model(window)[0, -1, :vocab].float().argmax())
            if token == self.eos:
                break
            context.append(token)
            new.append(token)
        return new


def run_sampler(data_path: str | None, vocab_size: int, prompt: str, max_new_tokens: int) -> Sampler | None:
    """The sampler of a peer whose dataset copy is at `data_path` (its tokenizer), the byte tokenizer for a
    256-token run without one; None (said once) when the run's tokenizer is not on this machine."""
    from dilocod.data.tokenizer import BYTE, eos_id, load_tokenizer

    file = Path(data_path) / TOKENIZER_FILE if data_path else None
    if file is not None and file.is_file():
        tok = load_tokenizer(file)
    elif vocab_size == BYTE_VOCAB:
        tok = load_tokenizer(BYTE)
    else:
        log.info("no samples of θ_global: the run's tokenizer is not on this machine")
        return None
    return Sampler(tok, prompt, max_new_tokens, eos_id(tok))
