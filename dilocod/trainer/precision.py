"""Whether this machine computes bf16 matrix products fast, and so which dtype low-precision work takes.

On CUDA, bf16 runs on tensor cores: kept. On a CPU it depends on the CPU: one with AMX or AVX-512 BF16
multiplies bf16 matrices natively, faster than fp32; one without (AVX2 only, or AVX-512 without its BF16
extension) converts every element and multiplies in fp32 through a slow path. Measured on one Xeon with
AMX (oneDNN limited to AVX2 to stand for a CPU without it, `ONEDNN_MAX_CPU_ISA=AVX2`): a 512 × 512
product takes 0.8 ms in fp32, 0.2 ms in bf16 natively, 119 ms emulated; limited to AVX512_CORE, 3.3 ms.
Muon's Newton–Schulz iterations are five such products a matrix every inner step, so on such a CPU
its step cost ~7× AdamW's instead of ~1.2×.

A CPU's flags do not settle it alone (a hypervisor may hide them, a torch build may not use them), so
the decision is what the machine does: one short probe per process (~60 ms at worst) that times the
same product in both dtypes. The ratio it tells apart is ~100× (emulated) against ~0.3× (native), far
beyond the noise of a busy machine.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)

PROBE_SIZE = 256  # the product timed: large enough that fp32 is not dominated by call overhead
PROBE_REPEATS = 3  # timed runs of each dtype, interleaved; the fastest of each counts


@functools.cache
def bf16_is_fast(device_type: str) -> bool:
    """Whether bf16 matrix products on `device_type` ("cpu", "cuda", …) are at least as fast as fp32's.

    CUDA: yes. CPU: the probe decides, once per process, and logs what it found."""
    if device_type != "cpu":
        return True
    bf16_seconds, fp32_seconds = probe_matmul_seconds()
    fast = prefers_bf16(bf16_seconds, fp32_seconds)
    log.info(
        "this CPU (%s) multiplies %d×%d matrices in %.2f ms in bf16 against %.2f ms in fp32: "
        "low-precision work (Muon's orthogonalisation) runs in %s",
        torch.backends.cpu.get_cpu_capability(),
        PROBE_SIZE,
        PROBE_SIZE,
        bf16_seconds * 1e3,
        fp32_seconds * 1e3,
        "bf16" if fast else "fp32",
    )
    return fast


def prefers_bf16(bf16_seconds: float, fp32_seconds: float) -> bool:
    """bf16 only where it is no slower: it saves nothing on a CPU otherwise (its tensors here are small)."""
    return bf16_seconds <= fp32_seconds


def low_precision_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device multiplies it fast, else fp32."""
    return torch.bfloat16 if bf16_is_fast(device.type) else torch.float32


def probe_matmul_seconds() -> tuple[float, float]:
    """(bf16, fp32) seconds of one PROBE_SIZE² product on the CPU, the fastest of PROBE_REPEATS each."""
    a32 = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=torch.Generator().manual_seed(0))
    a16 = a32.bfloat16()
    best = {torch.bfloat16: float("inf"), torch.float32: float("inf")}
    for _ in range(PROBE_REPEATS + 1):  # the first round warms the kernels up (and is counted too)
        for a in (a16, a32):
            started = time.perf_counter()
            torch.mm(a, a)
            best[a.dtype] = min(best[a.dtype], time.perf_counter() - started)
    return best[torch.bfloat16], best[torch.float32]
