"""Local training for dilocod: the model, the data pipeline and the inner optimizer loop.

Depends on torch and the standard library only, so it can be tested and benchmarked without
any networking stack.
"""

from .batches import Corpus, DataConfig, DataError, ShardSampler, eval_batches, load_corpus
from .flops import flops_per_token, known_peak_flops, mfu
from .inner import InnerTrainer, StepStats
from .localgroup import LocalGroup, LocalGroupError
from .model import PRESETS, ModelConfig, ModelSpec, Transformer, build_model, count_params
from .settings import TrainerConfig, lr_at, resolve_device, resolve_devices

__all__ = [
    "PRESETS",
    "Corpus",
    "DataConfig",
    "DataError",
    "InnerTrainer",
    "LocalGroup",
    "LocalGroupError",
    "ModelConfig",
    "ModelSpec",
    "ShardSampler",
    "StepStats",
    "TrainerConfig",
    "Transformer",
    "build_model",
    "count_params",
    "eval_batches",
    "flops_per_token",
    "known_peak_flops",
    "load_corpus",
    "lr_at",
    "mfu",
    "resolve_device",
    "resolve_devices",
]
