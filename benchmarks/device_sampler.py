"""Time `engine.device_sampler.sample_on_device` against the reference `engine.sampler.sample` on one
device, for a few batch shapes and kinds of request. Each figure is the median of the timed calls
(host and device together: the call ends with its read-back).

    python benchmarks/device_sampler.py --device cuda --rows 64 256 --vocab 49152 151936
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.device_sampler import sample_on_device
from engine.request import Request
from engine.sampler import sample
from engine.sampling_params import SamplingParams

KINDS = ("greedy", "sampled", "mixed")


def requests(kind: str, rows: int) -> list[Request]:
    out = []
    for i in range(rows):
        if kind == "greedy" or (kind == "mixed" and i % 2 == 0):
            p = SamplingParams(temperature=0, logprobs=5 if kind == "mixed" and i % 4 == 0 else None)
        elif kind == "mixed" and i % 4 == 1:
            p = SamplingParams(temperature=0.8, seed=i, repetition_penalty=1.1, frequency_penalty=0.2)
        else:
            p = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i)
        req = Request(f"r{i}", list(range(1, 200)), p)
        req.output_token_ids = list(range(300, 400))
        req.sample_seed, req.generator = i, torch.Generator().manual_seed(i)
        out.append(req)
    return out


def timed(fn, logits: torch.Tensor, reqs: list[Request], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms caches and is dropped
        x = logits.clone()
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x, reqs, frozenset({0}))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--reference-repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), ms per call")
    print(f"{'kind':8} {'rows':>5} {'vocab':>7} {'device':>9} {'reference':>10}")
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, device=args.device) * 3
            for kind in KINDS:
                reqs = requests(kind, rows)
                ours = timed(sample_on_device, logits, reqs, args.repeats)
                ref = timed(sample, logits, reqs, args.reference_repeats)
                print(f"{kind:8} {rows:5d} {vocab:7d} {ours:9.2f} {ref:10.2f}", flush=True)


if __name__ == "__main__":
    main()
