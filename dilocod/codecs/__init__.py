"""Pseudo-gradient codecs (`averaging.compression`) and error feedback. Pure tensor code: torch + stdlib.

See `base` for the interface and its determinism/robustness contracts, `quant` for each codec's byte
layout and error bound, `topk` for the sparse codec, `feedback` for error feedback.
"""

from dilocod.codecs.base import Codec, CodecError, Payload
from dilocod.codecs.feedback import ErrorFeedback, roundtrip
from dilocod.codecs.quant import (
    CODEC_NAMES,
    DEFAULT_BLOCK_SIZE,
    FEEDBACK_CODECS,
    BlockQuantCodec,
    Fp16Codec,
    NoneCodec,
    bytes_per_element,
    make_codec,
)
from dilocod.codecs.topk import TOPK_VALUE_BITS, TopKCodec, topk_per_chunk

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_BLOCK_SIZE",
    "FEEDBACK_CODECS",
    "BlockQuantCodec",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Fp16Codec",
    "NoneCodec",
    "TOPK_VALUE_BITS",
    "TopKCodec",
    "Payload",
    "bytes_per_element",
    "make_codec",
    "roundtrip",
    "topk_per_chunk",
]
