"""A run's tokenizer as Hugging Face tokenizer files (`AutoTokenizer.from_pretrained` loads them).

The files are the `tokenizers` JSON the dataset was prepared with plus a tokenizer_config.json naming the
end-of-document token. For the byte tokenizer that token is byte 0's symbol ("Ā", chr(256)): marked special
as it is, the character "Ā" in a text would be read as the token instead of as its two UTF-8 bytes, so the
config sets `split_special_tokens`, which tokenizes every text as plain bytes, as `dilocod data prepare`
does. A BPE tokenizer keeps its `<|endoftext|>` an ordinary special token.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from dilocod.data.tokenizer import eos_id, is_byte_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def hf_tokenizer(tok: Tokenizer, *, max_len: int) -> PreTrainedTokenizerFast:
    """`tok` wrapped for transformers, its end-of-document token named, sequences capped at `max_len`."""
    from transformers import PreTrainedTokenizerFast

    eos = tok.id_to_token(eos_id(tok))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        split_special_tokens=is_byte_tokenizer(tok),
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,  # decoding must give back the exact text
    )


def write_tokenizer(tok: Tokenizer, out: Path, *, max_len: int) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into `out`; the names of the files written."""
    return [Path(p).name for p in hf_tokenizer(tok, max_len=max_len).save_pretrained(str(out))]
