"""The load generator as a library for benchmark scripts (the code lives in `deployments/bench_cli.py`,
so that `pdserve bench` ships with the installed package).

    from loadgen import BenchConfig, run_benchmark, print_report
    result = run_benchmark(BenchConfig(base_url="http://127.0.0.1:8000", model="SmolLM2-135M-Instruct",
                                       num_prompts=32, input_len_range=(64, 256), output_len_range=(32, 128)))
    result["metrics"]["output_throughput"], result["metrics"]["ttft_ms"]["p99"]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deployments.bench_cli import (  # noqa: E402
    BenchConfig,
    BenchRequest,
    RequestResult,
    arrival_offsets,
    arun_benchmark,
    compute_metrics,
    make_requests,
    plot_results,
    print_report,
    run_benchmark,
)

__all__ = ["BenchConfig", "BenchRequest", "RequestResult", "arrival_offsets", "arun_benchmark", "compute_metrics",
           "make_requests", "plot_results", "print_report", "run_benchmark"]
