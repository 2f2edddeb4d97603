"""Every config key is either run-wide (in the run's manifest: every participant shares it) or local (this
machine's own). `tests/test_manifest_keys.py` fails when a key is added to the config without a class.

Run-wide: what changes the model, the dataset (by its content hash) every peer's shard is cut from, what a
round is and how its contributions are combined and carried; peers that differ in one of them cannot
average together, or would train something else. Local: where this machine listens and keeps its data (and a copy of the run's starting weights) (and
how the node starting the run prepares it), what it computes on, how it spends its own memory (the error-feedback residual's precision) and time (gradient accumulation keeps the run's tokens per step), how long it waits for its own
downloads, how often it writes a checkpoint, its own trust policy, the run key (a secret: the manifest only says whether one is required),
and the adversary modes of the test benches.
"""

from __future__ import annotations

RUN_WIDE: dict[str, tuple[str, ...]] = {
    "run": ("id", "seed"),
    "model": ("preset", "vocab_size", "init", "hf_config_json"),
    "data": ("dataset", "num_shards"),
    "trainer": (
        "inner_steps", "batch_size", "seq_len", "lr", "weight_decay", "warmup_steps", "total_steps",
        "min_lr_ratio", "grad_clip", "optimizer", "muon_lr_ratio", "sample_prompt", "sample_tokens",
    ),
    "round": ("tokens", "max_seconds"),
    "outer": ("optimizer", "lr", "momentum", "nesterov", "beta2", "tau", "overlap", "fragments", "mix_alpha"),
    "averaging": (
        "group_size", "min_group_size", "min_matchmaking_time", "matchmaking_timeout", "allreduce_timeout",
        "request_timeout", "reducer", "trim_fraction", "clip_tau", "clip_iters", "clip_tol",
        "screen_norm_ratio", "compression", "adaptive_deadlines", "deadline_factor", "min_allreduce_timeout",
        "topk_density", "topk_chunk", "topk_value_bits", "ef_decay",
    ),
    "scoring": ("enabled", "sequences", "step"),
}  # fmt: skip

LOCAL: dict[str, tuple[str, ...]] = {
    "run": ("key",),
    "model": ("init_from", "hf_config"),
    "data": ("source", "tokenizer", "text_field", "eval_fraction", "max_bytes", "path", "serve_bandwidth",
             "bulk_port", "chunk_tokens", "lease_seconds"),
    "trainer": (
        "eval_every", "eval_batches", "device", "threads", "devices", "compile", "activation_checkpointing",
        "peak_flops", "micro_batch_size", "sample_every",
    ),
    "outer": ("rebase_on_resync",),
    "averaging": ("state_timeout", "ban_seconds", "residual_dtype"),
    "net": ("host", "port", "announce", "reachability", "status_interval", "bandwidth"),
    "checkpoint": ("every",),
    "adversary": ("mode", "alie_z", "stale_rounds"),
}  # fmt: skip


def is_run_wide(section: str, key: str) -> bool:
    return key in RUN_WIDE.get(section, ())
