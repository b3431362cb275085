"""OpenAI API parity with the official `openai` client, colocated (one engine in process behind the HTTP
app: the single-process layout of `pdserve serve`) and disaggregated (Serve ingress -> router -> 1 prefill + 2 decode workers, real KV transfer):
logprobs (checked against transformers' forward pass), echo and prompt logprobs, max_tokens 0, n with a
seed, batched prompts, penalties and logit_bias (greedy output equal to transformers' generate with the
same logits processors), streamed and not; gRPC's logprobs and n; a decode worker killed under a
logprobs stream."""

from __future__ import annotations

import collections
import time

import pytest
import ray
import torch
from openai import OpenAI
from ray import serve
from transformers import AutoModelForCausalLM, LogitsProcessor

from deployments.app import NAMESPACE, ROUTER_NAME, build_app, build_grpc_app
from deployments.config import ServeConfig
from deployments.local_server import build_single_process_app
from engine.model_loader import resolve_model_dir
from helpers import ThreadedServer, free_port, local_serve, wait_for, wait_no_leaks

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# |served - transformers| for a logprob: both fp32 on CPU, different kernels (paged SDPA vs eager).
LOGPROB_TOL = 2e-3
EOS_OFF = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf():
    """transformers' model on the same weights: the reference for logprobs and penalties."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None, torch.float32), torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def colocated():
    """The single-process layout's app (`pdserve serve --layout single`): one engine in this process."""
    app, backend = build_single_process_app(ServeConfig.from_dict({"num_threads": 2, "dtype": "float32"}))
    with ThreadedServer(app) as srv:
        yield srv.url, backend.engine.tokenizer
    backend.shutdown()


@pytest.fixture(scope="module")
def disaggregated():
    gport = free_port()
    with local_serve(4, grpc_port=gport) as port:
        # local_prefill_max_tokens 0: every prompt goes through the prefill pool and its KV moves.
        args = {"num_prefill_workers": 1, "num_decode_workers": 2, "kv_cache_memory_mb": 64, "max_num_seqs": 16,
                "local_prefill_max_tokens": 0}
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        serve.run(build_grpc_app(args), name="pdserve-grpc", route_prefix="/pdserve-grpc")
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        yield f"http://127.0.0.1:{port}", router, gport


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def client(request):
    url = request.getfixturevalue(request.param)[0]
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tokenizer(colocated):
    return colocated[1]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i predicts ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_greedy(hf, ids: list[int], n: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, **kwargs)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------- logprobs
def test_completion_logprobs_match_transformers(client, tokenizer, hf):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body=EOS_OFF)
    choice = r.choices[0]
    prompt_ids = ids_of(tokenizer, PROMPT)
    gen = hf_greedy(hf, prompt_ids, 6)
    ref = hf_logprobs(hf, prompt_ids + gen)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in gen]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(value - row[gen[i]].item()) < LOGPROB_TOL
        best = torch.topk(row, 3)
        want = {tokenizer.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
        assert set(want) <= set(top) and len(top) <= 4  # the top 3, plus the chosen token when not among them
        assert all(abs(top[k] - v) < LOGPROB_TOL for k, v in want.items())
        assert value == max(top.values())  # greedy: the chosen token is the best


def test_chat_logprobs_match_transformers_streamed_and_not(client, tokenizer, hf):
    # 6 tokens: "The capital of France is Paris." ends with EOS as its 8th.
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    prompt_ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids if isinstance(prompt_ids, list) else prompt_ids["input_ids"])
    gen = hf_greedy(hf, prompt_ids, 6)
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in gen]
    ref = hf_logprobs(hf, prompt_ids + gen)
    for i, c in enumerate(content):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(c.logprob - row[gen[i]].item()) < LOGPROB_TOL
        assert bytes(c.bytes) == c.token.encode()
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert abs(c.top_logprobs[0].logprob - row.max().item()) < LOGPROB_TOL
    stream = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for ch in stream for ch_choice in ch.choices if ch_choice.logprobs
                for e in ch_choice.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


# ---------------------------------------------------------------------- echo
def test_echo_scores_the_prompt_with_max_tokens_0(client, tokenizer, hf):
    prompt_ids = ids_of(tokenizer, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt_ids)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in prompt_ids] and lp.token_logprobs[0] is None
    ref = hf_logprobs(hf, prompt_ids)
    for i in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, prompt_ids[i]].item()) < LOGPROB_TOL
    # With generation: the prompt, then the completion, in text and logprobs; streamed alike.
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=0,
                                     temperature=0, extra_body=EOS_OFF).choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body=EOS_OFF).choices[0]
    assert full.text == PROMPT + plain.text
    assert len(full.logprobs.tokens) == len(prompt_ids) + 4 and full.logprobs.token_logprobs[0] is None
    assert full.logprobs.text_offset[len(prompt_ids)] == len(PROMPT)
    parts = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=0,
                                           temperature=0, stream=True, extra_body=EOS_OFF))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.text
    assert sum((p.choices[0].logprobs.tokens for p in parts if p.choices and p.choices[0].logprobs), []) == \
        full.logprobs.tokens


# ---------------------------------------------------------------------- n and batches
def test_n_with_seed_is_reproducible_and_distinct(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234, n=3,
                  extra_body=EOS_OFF)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) >= 2
    # Sample i is the request seeded seed + i.
    alone = client.completions.create(**{**kwargs, "n": 1, "seed": 1235})
    assert alone.choices[0].text == texts[1]
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == alone.usage.prompt_tokens
    # Streamed: chunks carry their index; each index's text is its choice's.
    got = collections.defaultdict(str)
    for ch in client.completions.create(**kwargs, stream=True):
        for c in ch.choices:
            got[c.index] += c.text
    assert [got[i] for i in range(3)] == texts


def test_batched_prompts_give_one_choice_per_prompt_and_sample(client, tokenizer):
    prompts = ["The capital of France is", "Water boils at"]
    token_prompt = ids_of(tokenizer, "One, two, three,")
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0,
                                         extra_body=EOS_OFF).choices[0].text for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2,
                                  extra_body=EOS_OFF)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.prompt_tokens == sum(len(ids_of(tokenizer, p)) for p in prompts)
    assert r.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[token_prompt, token_prompt], max_tokens=3, temperature=0,
                                    stream=True, stream_options={"include_usage": True}, extra_body=EOS_OFF)
    got, usage = collections.defaultdict(str), None
    for ch in ids:
        usage = ch.usage or usage
        for c in ch.choices:
            got[c.index] += c.text
    assert set(got) == {0, 1} and got[0] == got[1] and usage.prompt_tokens == 2 * len(token_prompt)


# ---------------------------------------------------------------------- penalties and biases
class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens (the reference formula)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for t, count in collections.Counter(ids).items():
                scores[row, t] -= self.presence + self.frequency * count
        return scores


def test_penalties_equal_transformers_processors(client, tokenizer, hf):
    from transformers import LogitsProcessorList

    prompt = "List the colors: red, blue, red, blue, red,"
    ids = ids_of(tokenizer, prompt)
    n = 12

    def served(**extra):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={**EOS_OFF, **extra})
        return ids_of(tokenizer, r.choices[0].text)

    plain = hf_greedy(hf, ids, n)
    rep = hf_greedy(hf, ids, n, repetition_penalty=1.5)
    assert rep != plain  # the penalty changes this output
    assert served(repetition_penalty=1.5) == rep
    pf = hf_greedy(hf, ids, n, logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 0.8, 0.6)]))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, presence_penalty=0.8,
                                  frequency_penalty=0.6, extra_body=EOS_OFF)
    assert ids_of(tokenizer, r.choices[0].text) == pf
    banned = plain[0]
    biased = hf_greedy(hf, ids, n, sequence_bias={(banned,): -100.0})
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                  logit_bias={str(banned): -100}, extra_body=EOS_OFF)
    assert ids_of(tokenizer, r.choices[0].text) == biased and banned not in biased
    assert served(min_p=0.5) == plain  # min_p keeps the top token: greedy is unchanged


def test_bad_values_name_their_parameter(client):
    import openai

    for kwargs, param in [(dict(logprobs=21), "logprobs"), (dict(n=17), "n"), (dict(presence_penalty=2.5),
                                                                                 "presence_penalty"),
                          (dict(logit_bias={"99999999": 1}), "logit_bias"), (dict(logit_bias={"5": 101}),
                                                                                "logit_bias"),
                          (dict(extra_body={"min_p": 1.5}), "min_p"),
                          (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)


# ---------------------------------------------------------------------- disaggregated only: gRPC, migration
def test_grpc_logprobs_and_n(disaggregated, tokenizer, hf):
    import grpc

    from deployments.frontend.grpc import pdserve_pb2, pdserve_pb2_grpc

    _, router, gport = disaggregated
    prompt_ids = ids_of(tokenizer, PROMPT)
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        req = pdserve_pb2.GenerateRequest(prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True, n=2,
                                          logprobs=2, prompt_logprobs=0, repetition_penalty=1.0)
        chunks = list(stub.Generate(req, metadata=(("application", "pdserve-grpc"),), timeout=180))
    by_index = collections.defaultdict(list)
    for c in chunks:
        by_index[c.index].append(c)
    assert set(by_index) == {0, 1}
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids) and chunks[-1].usage.completion_tokens == 8
    for mine in by_index.values():
        gen = [t for c in mine for t in c.token_ids]
        lps = [x for c in mine for x in c.logprobs]
        assert [x.token_id for x in lps] == gen and all(len(x.top) == 2 for x in lps)
        prompt_lps = [x for c in mine for x in c.prompt_logprobs]
        assert [x.token_id for x in prompt_lps] == prompt_ids and not prompt_lps[0].HasField("logprob")
        ref = hf_logprobs(hf, prompt_ids + gen)
        assert all(abs(x.logprob - ref[len(prompt_ids) - 1 + i, x.token_id].item()) < LOGPROB_TOL
                   for i, x in enumerate(lps))
        assert all(abs(x.logprob - ref[i - 1, x.token_id].item()) < LOGPROB_TOL
                   for i, x in enumerate(prompt_lps) if i)
    wait_no_leaks(router, timeout_s=30)


def test_logprobs_stream_survives_a_decode_worker_death(disaggregated):
    url, router, _ = disaggregated
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.completions.create(model=MODEL, prompt="Tell me a long story about a dragon.", max_tokens=60,
                                       temperature=0, logprobs=1, stream=True, extra_body=EOS_OFF)
    tokens, logprobs, killed, finish = 0, 0, False, None
    for ch in stream:
        for c in ch.choices:
            if c.logprobs:
                tokens += len(c.logprobs.tokens)
                logprobs += sum(v is not None for v in c.logprobs.token_logprobs)
            finish = c.finish_reason or finish
        if tokens >= 5 and not killed:
            workers = ray.get(router.workers.remote())
            busy = wait_for(lambda: [w for name, w in workers.items() if "decode" in name
                                     and ray.get(w.num_requests.remote()) > 0], timeout_s=30, what="decode worker")
            ray.kill(busy[0])
            killed = time.monotonic()
    assert killed and finish == "length"
    assert tokens == logprobs == 60  # every token has its logprob, none repeated or lost
