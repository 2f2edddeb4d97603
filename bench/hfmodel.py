"""dilocod's model against `transformers`' LlamaForCausalLM of the same shape: training tokens/s on CPU, side by side.

    .venv/bin/python bench/hfmodel.py [--presets tiny,llama-20m] [--batch 4] [--seq 256] [--steps 6]
        [--repeats 3] [--threads 2] [--compile both|off|on] [--export llama-150m] [--sample tiny]
        [--trainer tiny,llama-20m [--trainer-compile]]

Both models get the same weights (`export.hf.llama_tensors`; their logits are checked to agree first), the
same batch, the same loss (cross-entropy on the logits, fp32) and AdamW, in one process with the same torch
threads. One repeat = `--steps` timed train steps of ours, then of HF's (after warm-up steps, which is also
where torch.compile compiles); the table gives each side's median tokens/s and the median of the per-repeat
ratios ours ÷ HF's (> 1: ours is faster). `--export PRESET` times writing that preset's θ_global as a Hugging
Face directory (`export.export.write_model` + tokenizer files) and gives its size; `--sample PRESETS` times
one dashboard sample (48 greedy tokens, `trainer.sampling.Sampler`) of each against one train step.

`--trainer PRESETS` measures what `model.hf_config` costs a peer: the trainer a peer's trainer thread runs
(`InnerTrainer.train_steps`: its loss, optimizer, clipping and schedule) on dilocod's model of each preset,
and on the `model.hf_config` model of a Llama config of the same shape (`HFCausalLM` around
LlamaForCausalLM, built from the pinned JSON as a peer builds it), same batches and seed, alternating
`--steps` steps of each per repeat; ratio = hf_config ÷ ours (< 1: the hf_config path is slower).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.data.tokenizer import BYTE, load_tokenizer  # noqa: E402
from dilocod.export.export import write_model  # noqa: E402
from dilocod.export.hf import llama_config_dict, llama_tensors  # noqa: E402
from dilocod.export.hftokenizer import write_tokenizer  # noqa: E402
from dilocod.trainer.model import ModelConfig, Transformer, build_model, count_params  # noqa: E402


def hf_twin(ours: Transformer) -> nn.Module:
    """LlamaForCausalLM of our model's shape holding our weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**llama_config_dict(ours.spec))
    cfg._attn_implementation = "sdpa"  # what ours runs (F.scaled_dot_product_attention)
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(
        llama_tensors(list(ours.state_dict().values()), ours.spec), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def train_step_fn(model: nn.Module, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], None]:
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(logits_of(forward, x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(
    step: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor, y: torch.Tensor, n: int
) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step(x, y)
    return n * x.numel() / (time.perf_counter() - start)


def compare(preset: str, args: argparse.Namespace, compiled: bool) -> dict[str, object]:
    ours = build_model(ModelConfig(preset), seed=0).train()
    hf = hf_twin(ours).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, ours.spec.vocab_size, (args.batch, args.seq), generator=gen)
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        diff = float((logits_of(ours, x) - logits_of(hf, x)).abs().max())
    steps = {"ours": train_step_fn(ours, compiled), "hf": train_step_fn(hf, compiled)}
    warm = {name: time.perf_counter() for name in steps}
    for name, step in steps.items():  # warm-up (and compilation)
        warm[name] = time.perf_counter()
        for _ in range(args.warmup):
            step(x, y)
        warm[name] = time.perf_counter() - warm[name]
    rates: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(args.repeats):
        for name, step in steps.items():
            rates[name].append(timed(step, x, y, args.steps))
    ratios = [a / b for a, b in zip(rates["ours"], rates["hf"])]
    return {
        "preset": preset, "params": count_params(ours), "compile": compiled, "max_abs_logit_diff": diff,
        "ours_tokens_per_s": statistics.median(rates["ours"]), "hf_tokens_per_s": statistics.median(rates["hf"]),
        "ratio": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
        "warmup_seconds": {k: round(v, 1) for k, v in warm.items()},
    }  # fmt: skip


def export_cost(preset: str) -> dict[str, object]:
    model = build_model(ModelConfig(preset), seed=0)
    params = list(model.state_dict().values())
    tok = load_tokenizer(BYTE)  # the tokenizer's files are a few MB at most: the weights are the cost
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_model(Path(tmp), params, model.spec, eos=0)
        write_tokenizer(tok, Path(tmp), max_len=model.spec.max_seq_len)
        seconds = time.perf_counter() - start
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
    return {"preset": preset, "params": count_params(model), "seconds": round(seconds, 2), "bytes": size}


def sample_cost(preset: str, args: argparse.Namespace) -> dict[str, object]:
    """One dashboard sample (`trainer.sampling.Sampler`, 48 greedy tokens after "The") against one train step
    of `--batch` × `--seq` of the same model, alternating (`--repeats`): seconds and their ratio."""
    from dilocod.trainer.sampling import Sampler

    model = build_model(ModelConfig(preset), seed=0)
    sampler = Sampler(load_tokenizer(BYTE), "The", 48, -1)  # no EOS: all 48 tokens, the most a sample costs
    step = train_step_fn(model, compiled=False)
    x = torch.randint(0, model.spec.vocab_size, (args.batch, args.seq))
    sampler(model), step(x, x)  # warm-up
    samples, steps = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sampler(model)
        samples.append(time.perf_counter() - start)
        start = time.perf_counter()
        step(x, x)
        steps.append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(samples, steps)]
    return {"preset": preset, "sample_seconds": round(statistics.median(samples), 3),
            "step_seconds": round(statistics.median(steps), 3), "sample_per_step": round(statistics.median(ratios), 3),
            "batch": [args.batch, args.seq]}  # fmt: skip


def trainer_cost(preset: str, args: argparse.Namespace) -> dict[str, object]:
    """Train tokens/s of `InnerTrainer` on the preset and on a `model.hf_config` Llama of its shape."""
    from transformers import LlamaConfig

    from dilocod.config import load_config
    from dilocod.data.corpus import Corpus
    from dilocod.trainer import InnerTrainer

    spec = ModelConfig(preset).spec()
    pinned = json.dumps(
        LlamaConfig(**llama_config_dict(spec)).to_dict(), sort_keys=True, separators=(",", ":")
    )
    c = load_config(None, [f"trainer.batch_size={args.batch}", f"trainer.seq_len={args.seq}",
                           f"trainer.threads={args.threads}", 'trainer.optimizer="adamw"',
                           f"trainer.compile={'true' if args.trainer_compile else 'false'}"])  # fmt: skip
    tokens = torch.randint(0, spec.vocab_size, (200_000,), generator=torch.Generator().manual_seed(0))
    corpus = Corpus(train=tokens[:180_000], eval=tokens[180_000:], name="random")
    trainers = {
        "ours": InnerTrainer(ModelConfig(preset), c.data, c.trainer, seed=0, peer_key="p", corpus=corpus),
        "hf_config": InnerTrainer(ModelConfig(hf_config_json=pinned), c.data, c.trainer, seed=0, peer_key="p",
                                  corpus=corpus),
    }  # fmt: skip
    for trainer in trainers.values():
        trainer.train_steps(args.warmup)
    rates: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            stats = trainer.train_steps(args.steps)
            rates[name].append(stats.tokens / stats.seconds)
    ratios = [a / b for a, b in zip(rates["hf_config"], rates["ours"])]
    return {
        "preset": preset, "params": count_params(trainers["ours"].model),
        "hf_params": count_params(trainers["hf_config"].model), "compile": args.trainer_compile,
        "ours_tokens_per_s": round(statistics.median(rates["ours"])),
        "hf_config_tokens_per_s": round(statistics.median(rates["hf_config"])),
        "ratio_hf_config_over_ours": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "flops_per_token": [trainers["ours"].flops_per_token, trainers["hf_config"].flops_per_token],
        "batch": [args.batch, args.seq],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,llama-20m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", choices=("both", "off", "on"), default="both")
    parser.add_argument("--export", default="", help="a preset to time the export of (e.g. llama-150m)")
    parser.add_argument("--sample", default="", help="presets to time one dashboard sample of (e.g. tiny)")
    parser.add_argument(
        "--trainer", default="", help="presets to time through InnerTrainer, ours vs hf_config"
    )
    parser.add_argument(
        "--trainer-compile", action="store_true", help="with --trainer: trainer.compile = true"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = {"both": [False, True], "off": [False], "on": [True]}[args.compile]
    for preset in filter(None, args.presets.split(",")):
        for compiled in modes:
            print(json.dumps(compare(preset, args, compiled)), flush=True)
    if args.export:
        print(json.dumps({"export": export_cost(args.export)}), flush=True)
    for preset in filter(None, args.sample.split(",")):
        print(json.dumps({"sample": sample_cost(preset, args)}), flush=True)
    for preset in filter(None, args.trainer.split(",")):
        print(json.dumps({"trainer": trainer_cost(preset, args)}), flush=True)


if __name__ == "__main__":
    main()
