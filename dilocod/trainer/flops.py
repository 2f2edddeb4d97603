"""Model FLOPs per token, the peak FLOP/s of known accelerators, and model FLOPs utilization (MFU).

MFU = (tokens/s × model FLOPs per token) ÷ (peak FLOP/s × devices), as in PaLM (Chowdhery et al. 2022,
appendix B): it counts the FLOPs the model needs, not what the hardware ran (activation checkpointing's
recomputation does not count), so it compares runs across recipes. Pure functions, no torch state.
"""

from __future__ import annotations

import re

from .shape import LMShape

# Dense bf16 tensor-core peaks (FLOP/s, no 2:4 sparsity) from the vendors' data sheets, keyed by a
# whole word of `torch.cuda.get_device_name()` ("A10" does not match "A100", "L4" not "L40"). The first
# match wins, so variants come before the family name ("H100 PCIe" before "H100"). Cards without bf16
# tensor cores list their fp16 peak. A device not listed has no MFU unless `trainer.peak_flops` is set.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("B100", 1.75e15),
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A40", 150e12),
    ("A30", 165e12),
    ("A10", 125e12),
    ("RTX 6000 Ada", 364e12),
    ("RTX A6000", 155e12),
    ("RTX 4090", 165e12),  # bf16 with fp32 accumulation (what torch uses)
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16: V100 has no bf16 tensor cores
    ("T4", 65e12),  # fp16
)


def flops_per_token(shape: LMShape, seq_len: int, num_params: int) -> float:
    """Training FLOPs (forward + backward) per token: 6·N + 12·layers·d_model·seq_len.

    N counts the parameters that take part in matrix multiplies: all but the input embedding, whose
    lookup costs no FLOPs, nor does a table of positions (a tied embedding is also the head, a matrix multiply: it counts). The second
    term is attention's scores and weighted sum (PaLM's formula; it does not halve for the causal mask).
    """
    matmul_params = num_params - shape.lookup_params
    return 6.0 * matmul_params + 12.0 * shape.n_layers * shape.d_model * seq_len


def known_peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device, from its name (None when it is not in `PEAK_FLOPS`)."""
    for key, flops in PEAK_FLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return flops
    return None


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1+) or None when the peak is unknown (e.g. a CPU, not overridden)."""
    if peak_flops is None or peak_flops <= 0:
        return None
    return tokens_per_second * flops_per_token / peak_flops
