"""The `pdserve` command line: `serve` (the server), `status` (the running server's map), `demo` (offline
generation), `bench` (load generator)."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, num_threads=args.threads)
    print(f"loaded {llm.engine.model_dir} in {time.perf_counter() - t0:.1f}s")
    questions = args.prompt or ["What is the capital of France?", "Give me three uses of a paperclip.",
                                "Write one sentence about the moon."]
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                    SamplingParams(max_tokens=args.max_tokens, temperature=0))
    dt = time.perf_counter() - t0
    for q, o in zip(questions, outs):
        print(f"\n> {q}\n{o.text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n{n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s, batch of {len(outs)})")
    return 0


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """The whole CLI. `serve_flags=False` leaves out `serve`'s flags, which are made from the settings
    dataclasses and so import the engine (torch): `pdserve bench` does not need them."""
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="offline generation on the engine alone (no Ray)")
    d.add_argument("--model", default=None, help="HF dir, .gguf file or cached hub id (default: embedded SmolLM2)")
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("prompt", nargs="*")
    d.set_defaults(func=_demo)
    try:
        from deployments.serve_cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub, flags=serve_flags)
    from deployments.status_cli import add_status_parser

    add_status_parser(sub)
    try:
        from deployments.bench_cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(serve_flags=not argv or argv[0] not in ("bench", "status")).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # a bad setting: its message names the field; no traceback
        from engine.errors import EngineConfigError  # ServeConfigError is one too

        if not isinstance(exc, EngineConfigError):
            raise
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
