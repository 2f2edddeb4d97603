"""The wire codecs side by side: bytes a value, encode and decode speed (docs/benchmarks.md "Codecs").

    .venv/bin/python bench/codecs.py [--elements 4194304] [--repeats 15] [--threads 1]

One process, one thread by default, the codecs interleaved round by round (this machine is noisy: each
figure is the best of `--repeats`), on a normal random tensor (a pseudo-gradient's values are about that).
MB/s are of fp32 input (4 bytes a value), encoded or decoded.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from dilocod.codecs import Codec, TopKCodec, make_codec


def codecs() -> list[tuple[str, Codec]]:
    dense = [(name, make_codec(name)) for name in ("none", "fp16", "int8", "int4", "int2")]
    sparse = [
        ("topk 1.56 % int2", TopKCodec(4096, 64, 2)),
        ("topk 1.56 % int4", TopKCodec(4096, 64, 4)),
        ("topk 0.78 % int2", TopKCodec(4096, 32, 2)),
    ]
    return dense + sparse


def measure(elements: int, repeats: int) -> list[tuple[str, float, float, float]]:
    x = torch.randn(elements, generator=torch.Generator().manual_seed(0))
    chosen = codecs()
    best = {name: [float("inf"), float("inf")] for name, _ in chosen}
    payloads = {name: codec.encode(x) for name, codec in chosen}
    for _ in range(repeats):
        for name, codec in chosen:
            started = time.perf_counter()
            codec.encode(x)
            encoded = time.perf_counter()
            codec.decode(payloads[name], elements)
            decoded = time.perf_counter()
            best[name][0] = min(best[name][0], encoded - started)
            best[name][1] = min(best[name][1], decoded - encoded)
    megabytes = 4 * elements / 1e6
    return [
        (name, len(payloads[name]) / elements, megabytes / best[name][0], megabytes / best[name][1])
        for name, _ in chosen
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/codecs.py", description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| codec | bytes/element | ÷ fp32 | encode MB/s | decode MB/s |")
    print("|---|---|---|---|---|")
    for name, per_element, encode, decode in measure(args.elements, args.repeats):
        print(f"| {name} | {per_element:.4f} | 1/{4 / per_element:.0f} | {encode:.0f} | {decode:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
