"""`pdserve bench`'s types and figures: the run's config, the per-request results, TTFT/TPOT/ITL/E2E
statistics, goodput under SLOs, the throughput timeline, the printed report and the plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run. Ranges are inclusive and override the fixed lengths when set."""

    base_url: str
    model: str
    num_prompts: int = 100
    request_rate: float = math.inf  # requests/s of a Poisson process; inf: all at t=0
    max_concurrency: int | None = None
    input_len: int = 128
    input_len_range: tuple[int, int] | None = None
    output_len: int = 128
    output_len_range: tuple[int, int] | None = None
    dataset: str | None = None  # JSONL with a "prompt" field (text or token ids); optional "max_tokens"
    vocab_size: int = 32000  # random prompt token ids are drawn from [low_token_id, vocab_size)
    low_token_id: int = 100  # skip the special tokens at the start of most vocabularies
    # Shared-prefix workload: each random prompt starts with one of `prefix_groups` random prefixes of
    # `prefix_len` tokens (a system prompt, few-shot examples), then its own input_len tokens.
    prefix_groups: int = 0
    prefix_len: int = 0
    seed: int = 0
    timeout_s: float = 600.0  # the whole run; unfinished requests then count as failed
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    progress: bool = True
    result_json: str | None = None
    plot: str | None = None
    # A load that shifts: phases run one after another, each `Phase` its own prompts, lengths and rate
    # (the whole run's num_prompts, input/output lengths and rate are then the phases'). Figures per phase.
    phases: tuple[Phase, ...] | None = None

    def __post_init__(self) -> None:
        if self.phases is not None:
            if not self.phases:
                raise ValueError("phases must name at least one phase")
            if self.dataset or self.input_len_range or self.output_len_range:
                raise ValueError("phases set each phase's lengths; they cannot go with dataset or length ranges")
            object.__setattr__(self, "num_prompts", sum(ph.num_prompts for ph in self.phases))
        if self.num_prompts <= 0:
            raise ValueError(f"num_prompts must be > 0, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be > 0, got {self.max_concurrency}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("input_len_range", "output_len_range"):
            r = getattr(self, name)
            if r is not None and not (1 <= r[0] <= r[1]):
                raise ValueError(f"{name} must be LO,HI with 1 <= LO <= HI, got {r}")
        if min(self.input_len, self.output_len) < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if self.prefix_groups < 0 or self.prefix_len < 0 or bool(self.prefix_groups) != bool(self.prefix_len):
            raise ValueError(f"prefix_groups and prefix_len must both be > 0 (or both 0), got "
                             f"{self.prefix_groups} and {self.prefix_len}")
        if self.prefix_groups and self.dataset:
            raise ValueError("prefix_groups / prefix_len shape random prompts; they cannot go with dataset")
        if not self.low_token_id < self.vocab_size:
            raise ValueError(f"low_token_id ({self.low_token_id}) must be below vocab_size ({self.vocab_size})")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown benchmark settings {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        for name in ("input_len_range", "output_len_range"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        if d.get("phases") is not None:
            d["phases"] = tuple(ph if isinstance(ph, Phase) else Phase.parse(ph) if isinstance(ph, str) else
                                Phase(**ph) if isinstance(ph, dict) else Phase(*ph) for ph in d["phases"])
        return cls(**d)


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of a shifting load (`BenchConfig.phases`): `num_prompts` random prompts of `input_len`
    tokens asking for `output_len`, arriving at `request_rate` per second (Poisson; inf: all at once)."""

    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = math.inf

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError(f"a phase needs num_prompts, input_len and output_len >= 1, got {self}")
        if not self.request_rate > 0:
            raise ValueError(f"a phase's request_rate must be > 0 (or inf), got {self.request_rate}")

    @classmethod
    def parse(cls, text: str) -> Phase:
        """`N,IN,OUT[,RATE]`, e.g. `40,512,8,2` (the `--phase` flag)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (3, 4):
            raise ValueError(f"a phase is N,INPUT_LEN,OUTPUT_LEN[,RATE], got {text!r}")
        try:
            return cls(int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) == 4 else math.inf)
        except ValueError as e:
            raise ValueError(f"phase {text!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What the client saw for one request; times are perf_counter seconds relative to the run start."""

    index: int
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens the server had cached
    usage_reported: bool = False
    ok: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]



def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean and percentiles (linear interpolation), in ms by default."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    xs = sorted(v * scale for v in values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": sum(xs) / len(xs), **{f"p{p}": pct(p) for p in PERCENTILES}}


def _meets_slo(cfg: BenchConfig, r: RequestResult) -> bool:
    if not r.ok:
        return False
    if cfg.slo_ttft_ms is not None and r.ttft * 1000.0 > cfg.slo_ttft_ms:
        return False
    tpot = r.tpot
    return cfg.slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= cfg.slo_tpot_ms


def compute_metrics(cfg: BenchConfig, results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Latencies in ms; rates per second of the whole run (first send to last completion)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.num_output_tokens for r in ok)
    good = sum(_meets_slo(cfg, r) for r in results)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:80]
            errors[key] = errors.get(key, 0) + 1
    return {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "usage_reported": sum(r.usage_reported for r in ok),
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.num_prompt_tokens for r in ok),
        # Prompt tokens the server reported served from its prefix cache (usage.prompt_tokens_details).
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "goodput": good / duration_s,
        "good_requests": good,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itls]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def phase_metrics(cfg: BenchConfig, results: list[RequestResult]) -> list[dict[str, Any]] | None:
    """`compute_metrics` of each phase's requests (in request order, the phases' order), each over its
    own span: its first send to its last completion. None without phases."""
    if not cfg.phases:
        return None
    out, first = [], 0
    for i, ph in enumerate(cfg.phases):
        rs = results[first:first + ph.num_prompts]
        first += ph.num_prompts
        ends = [r.start + r.e2e for r in rs if r.ok and r.e2e is not None]
        start = min(r.start for r in rs)
        span = max(ends) - start if ends else 0.0
        m = compute_metrics(cfg, rs, max(span, 1e-9))
        out.append({"phase": i, "input_len": ph.input_len, "output_len": ph.output_len,
                    "request_rate": ph.request_rate, "start_s": start, **m})
    return out


def throughput_timeline(results: list[RequestResult], bucket_s: float = 1.0) -> list[tuple[float, float]]:
    """(bucket start s, output tokens/s) with each request's tokens spread over its content chunks."""
    counts: dict[int, float] = {}
    for r in results:
        if not r.ok or not r.chunk_times:
            continue
        per_chunk = r.num_output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            counts[int(t // bucket_s)] = counts.get(int(t // bucket_s), 0.0) + per_chunk
    if not counts:
        return []
    return [(b * bucket_s, counts.get(b, 0.0) / bucket_s) for b in range(max(counts) + 1)]


def _request_row(r: RequestResult) -> dict[str, Any]:
    return {"index": r.index, "ok": r.ok, "error": r.error, "max_tokens": r.max_tokens,
            "output_tokens": r.num_output_tokens, "prompt_tokens": r.num_prompt_tokens,
            "cached_tokens": r.num_cached_tokens, "start_s": r.start, "ttft_s": r.ttft, "tpot_s": r.tpot,
            "e2e_s": r.e2e}


# ---------------------------------------------------------------------------------------------- output


_SPEC_COUNTS = ("num_drafted", "num_accepted", "num_emitted", "num_verified_rows")


def server_speculation(health: Any) -> dict[str, dict[str, Any]]:
    """Each decode worker's speculative-decoding counters from a pdserve `/health` answer (with the API
    key: the router's details); {} when none speculates or the server is not pdserve."""
    decode = ((health or {}).get("router") or {}).get("decode") if isinstance(health, dict) else None
    if not isinstance(decode, dict):
        return {}
    return {wid: w["speculation"] for wid, w in decode.items() if isinstance(w, dict) and w.get("speculation")}


def speculation_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What the server's decode workers drafted, accepted and emitted between two `server_speculation`
    readings (a worker new since `before` counts from zero; one that died meanwhile is lost), with
    the acceptance rate and mean accepted length of that difference. None: nothing speculated."""
    total = dict.fromkeys(_SPEC_COUNTS, 0)
    methods = set()
    for wid, now in after.items():
        old = before.get(wid) or {}
        if any(now.get(k, 0) < old.get(k, 0) for k in _SPEC_COUNTS):  # a new worker under the same id
            old = {}
        for k in _SPEC_COUNTS:
            total[k] += now.get(k, 0) - old.get(k, 0)
        methods.add(str(now.get("method")))
    if not after:
        return None
    total["method"] = "+".join(sorted(methods))
    total["acceptance_rate"] = total["num_accepted"] / total["num_drafted"] if total["num_drafted"] else 0.0
    total["mean_accepted_length"] = (total["num_emitted"] / total["num_verified_rows"]
                                     if total["num_verified_rows"] else 0.0)
    return total


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def print_report(result: dict, title: str = "pdserve bench") -> None:
    """A rich table of the metrics of one `run_benchmark` result."""
    from rich.console import Console
    from rich.table import Table

    m, c = result["metrics"], result["config"]
    table = Table(title=f"{title}: {c['base_url']} model={c['model']}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    slo = ", ".join(f"{k}<={c[k]}" for k in ("slo_ttft_ms", "slo_tpot_ms") if c[k] is not None) or "none"
    for name, value in [("requests ok / failed", f"{m['completed']} / {m['failed']}"),
                        ("duration (s)", _f(m["duration_s"], 2)),
                        ("request throughput (req/s)", _f(m["request_throughput"], 2)),
                        ("output throughput (tok/s)", _f(m["output_throughput"], 1)),
                        (f"goodput (req/s, SLO {slo})", _f(m["goodput"], 2)),
                        ("output tokens (usage-reported reqs)", f"{m['total_output_tokens']} ({m['usage_reported']})"),
                        ("prompt tokens / of them cached", f"{m['total_prompt_tokens']} / {m['cached_prompt_tokens']}")]:
        table.add_row(name, value)
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = m[key]
        table.add_row(f"{label} ms mean / p50 / p90 / p99",
                      " / ".join(_f(s[k]) for k in ("mean", *(f"p{p}" for p in PERCENTILES))))
    if (spec := result.get("server_speculation")) is not None:
        table.add_row(f"speculation ({spec['method']}): drafted / accepted / emitted",
                      f"{spec['num_drafted']} / {spec['num_accepted']} / {spec['num_emitted']}")
        table.add_row("acceptance rate / mean accepted length",
                      f"{spec['acceptance_rate']:.1%} / {_f(spec['mean_accepted_length'], 2)}")
    console = Console(width=120)
    console.print(table)
    if result.get("phases"):
        pt = Table(title="per phase (TTFT / TPOT in ms)", title_justify="left")
        for col in ("phase", "prompts x in -> out @ rate", "ok / failed", "TTFT p50 / p99", "TPOT p50 / p99",
                    "goodput (req/s)", "good"):
            pt.add_column(col, justify="right")
        for ph in result["phases"]:
            pt.add_row(str(ph["phase"]), f"{ph['num_requests']} x {ph['input_len']} -> {ph['output_len']} @ "
                       f"{ph['request_rate']:g}", f"{ph['completed']} / {ph['failed']}",
                       f"{_f(ph['ttft_ms']['p50'])} / {_f(ph['ttft_ms']['p99'])}",
                       f"{_f(ph['tpot_ms']['p50'])} / {_f(ph['tpot_ms']['p99'])}", _f(ph["goodput"], 2),
                       f"{ph['good_requests']}/{ph['num_requests']}")
        console.print(pt)
    for err, n in m["errors"].items():
        console.print(f"  [red]{n} failed[/red]: {err}")


def plot_results(result: dict, results: list[RequestResult], path: str) -> None:
    """Latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "E2E": [r.e2e for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, vals) in zip(axes.flat, series.items()):
        xs = sorted(v * 1000.0 for v in vals)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    tl = result["timeline"]
    ax.plot([t for t, _ in tl], [v for _, v in tl], marker=".")
    ax.set(title="output throughput", xlabel="s since start", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{result['config']['model']} @ {result['config']['base_url']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
