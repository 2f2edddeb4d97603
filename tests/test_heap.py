"""The daemon gives freed tensor memory back to the system, and knows its parameters' shapes before
building the model (so hivemind's forks happen before the model exists)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dilocod.trainer import DataConfig, InnerTrainer, ModelConfig, TrainerConfig
from dilocod.trainer.lm import parameter_template

REPO = Path(__file__).resolve().parent.parent

# 200 tensors of 1 MB (below glibc's mmap threshold once it has risen, so from the heap), the first of
# every pair kept: the freed half stays resident until the heap is trimmed.
PROBE = """
import sys, torch
from peers import heap
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
big = torch.ones(8 << 20, dtype=torch.uint8); del big  # raises glibc's dynamic mmap threshold
tensors = [torch.ones(1 << 18) for _ in range(200)]
del tensors[1::2]
before = rss_mb()
assert heap.trim()
print(before - rss_mb())
"""


def test_trim_gives_freed_tensors_back() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 50  # ~100 MB of freed 1 MB tensors; at least half goes back


def test_parameter_template_matches_the_trainers_parameters() -> None:
    model = ModelConfig("tiny")
    template = parameter_template(model)
    trainer = InnerTrainer(model, DataConfig(), TrainerConfig(batch_size=2, seq_len=16), seed=0, peer_key="t")
    assert [t.shape for t in template] == [p.shape for p in trainer.working_params_fp32()]
    assert all(t.device.type == "meta" for t in template)
