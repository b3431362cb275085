"""Fair shares between tenants in the scheduler (engine/fair_share.py): one tenant's flood does not hold
back another tenant's request, preemption takes the flooder's, and greedy outputs still equal
transformers'. Each test runs the same arrivals without tenants too, to show the order it checks is
the fair share's doing."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.config import EngineConfig, EngineConfigError
from engine.scheduler import HEAVY_PREFILL_BLOCKS, TENANT_ACTIVE_S
from engine.spec.suffix import SuffixProposer
from test_correctness import hf_greedy


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def _engine(model_dir: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, block_size=4, max_model_len=128, num_threads=1, **kw))


def _run(eng: LLMEngine) -> tuple[list[str], dict[str, list[int]]]:
    """Step to the end; (request ids in the order they got their first token, outputs)."""
    first: list[str] = []
    outs: dict[str, list[int]] = {}
    for _ in range(5000):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.request_id not in first and (o.new_token_ids or o.finished):
                first.append(o.request_id)
            if o.finished:
                outs[o.request_id] = o.token_ids
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
    return first, outs


def _flood(eng: LLMEngine, tenants: bool, n_flood: int = 16) -> None:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(n_flood):
        eng.add_request(f"a{i}", [rng.randrange(3, 200) for _ in range(12)], params,
                        **(dict(tenant="flooder") if tenants else {}))
    eng.add_request("b0", [rng.randrange(3, 200) for _ in range(12)], params,
                    **(dict(tenant="innocent") if tenants else {}))


def test_an_innocent_request_goes_ahead_of_a_flood_queued_before_it(model_dir):
    fair = _engine(model_dir, max_num_seqs=2, enable_prefix_caching=False)
    _flood(fair, tenants=True)
    order, outs = _run(fair)
    # One batch of two runs at a time: the innocent's request, queued after 16 of the flooder's, is in
    # the first batch (tags: its own cost against the flooder's growing sum).
    assert order.index("b0") <= 1, order
    # Without tenants the same arrivals run first come, first served: the innocent's goes last.
    fcfs = _engine(model_dir, max_num_seqs=2, enable_prefix_caching=False)
    _flood(fcfs, tenants=False)
    fcfs_order, fcfs_outs = _run(fcfs)
    assert fcfs_order.index("b0") == len(fcfs_order) - 1
    assert outs == fcfs_outs  # the order changed, not the tokens


def test_weights_set_the_shares_of_the_queue(model_dir):
    eng = _engine(model_dir, max_num_seqs=1, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(6):
        eng.add_request(f"h{i}", [5, 6, 7, 8], params, tenant="heavy", tenant_weight=2.0)
        eng.add_request(f"l{i}", [5, 6, 7, 8], params, tenant="light", tenant_weight=1.0)
    order, _ = _run(eng)
    # Weight 2 against 1, equal costs (6 tokens): heavy's finish tags 3, 6, 9, ...; light's 6, 12, ...
    # (a tie goes to the earlier arrival): two of heavy's for each of light's while both have some queued.
    assert "".join(r[0] for r in order) == "hlhhlhhlhlll", order


def _slots_run(model_dir: str, tenants: bool) -> tuple[int, dict[str, list[int]], LLMEngine]:
    """Two flood requests fill both slots; the innocent's arrives three steps later. Returns the steps
    the innocent's waited for its first token, and the outputs."""
    eng = _engine(model_dir, max_num_seqs=2, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    kw = (lambda t: dict(tenant=t)) if tenants else (lambda t: {})
    for i in range(3):
        eng.add_request(f"a{i}", [20 + i, 21, 22, 23, 24], params, **kw("flooder"))
    for _ in range(3):
        eng.step()
    eng.add_request("b0", [30, 31, 32, 33], params, **kw("innocent"))
    waited = 0
    outs: dict[str, list[int]] = {}
    first = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "b0" and first is None and o.new_token_ids:
                first = waited
            if o.finished:
                outs[o.request_id] = o.token_ids
        waited += 1
    eng.check_integrity()
    return first, outs, eng


def test_a_flood_that_fills_every_slot_gives_one_up_to_another_tenant(model_dir):
    fair_wait, outs, eng = _slots_run(model_dir, tenants=True)
    fcfs_wait, fcfs_outs, _ = _slots_run(model_dir, tenants=False)
    assert fair_wait <= 1  # the step that frees its slot admits nothing new (it preempted); the next one does
    assert fcfs_wait >= 25  # without tenants it waits for a flood request to end (30 tokens each)
    assert outs == fcfs_outs  # preempted requests recompute: the same tokens
    assert outs["b0"] == hf_greedy(eng.hf_model, [30, 31, 32, 33], 30, frozenset())


def _prefill_run(model_dir: str, tenants: bool) -> tuple[int, dict[str, list[int]], LLMEngine]:
    """Three long flood prompts prefill in chunks of a 32-token budget; the innocent's short one arrives
    after the first step. Returns the steps it waited for its first token, and the outputs."""
    eng = _engine(model_dir, max_num_seqs=8, max_num_batched_tokens=32, enable_prefix_caching=False,
                  enable_chunked_prefill=True)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    kw = (lambda t: dict(tenant=t)) if tenants else (lambda t: {})
    rng = random.Random(2)
    for i in range(3):
        eng.add_request(f"a{i}", [rng.randrange(3, 200) for _ in range(100)], params, **kw("flooder"))
    eng.step()
    eng.add_request("b0", [40, 41, 42, 43, 44, 45, 46, 47], params, **kw("innocent"))
    waited, first, outs = 0, None, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "b0" and first is None and o.new_token_ids:
                first = waited
            if o.finished:
                outs[o.request_id] = o.token_ids
        waited += 1
    eng.check_integrity()
    return first, outs, eng


def test_a_short_prompt_starts_while_a_heavier_tenants_long_prompts_prefill(model_dir):
    fair_wait, outs, eng = _prefill_run(model_dir, tenants=True)
    fcfs_wait, fcfs_outs, _ = _prefill_run(model_dir, tenants=False)
    assert fair_wait == 0  # part of the step's prompt budget was held back for it
    assert fcfs_wait >= 5  # without tenants the flood's chunks take every step's budget first
    assert outs == fcfs_outs
    assert outs["b0"] == hf_greedy(eng.hf_model, [40, 41, 42, 43, 44, 45, 46, 47], 4, frozenset())


def _preemption_run(model_dir: str, tenants: bool) -> tuple[list[str], dict[str, list[int]], LLMEngine]:
    # 20 blocks of 4 tokens: three requests of 12 + 24 tokens cannot all keep their KV to the end.
    eng = _engine(model_dir, num_kv_blocks=20, max_num_seqs=8, enable_prefix_caching=False)
    victims: list[str] = []
    preempt = eng.scheduler._preempt

    def record(req, out):
        victims.append(req.request_id)
        preempt(req, out)

    eng.scheduler._preempt = record
    rng = random.Random(1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"a{i}", [rng.randrange(3, 200) for _ in range(12)], params,
                        **(dict(tenant="flooder") if tenants else {}))
    eng.add_request("b0", [rng.randrange(3, 200) for _ in range(12)], params,
                    **(dict(tenant="innocent") if tenants else {}))
    _, outs = _run(eng)
    return victims, outs, eng


def test_preemption_takes_the_heaviest_tenants_request_and_outputs_equal_transformers(model_dir):
    victims, outs, eng = _preemption_run(model_dir, tenants=True)
    assert victims and "b0" not in victims, victims
    # Without tenants the newest request is the victim: the innocent's.
    plain_victims, plain_outs, _ = _preemption_run(model_dir, tenants=False)
    assert "b0" in plain_victims, plain_victims
    rng = random.Random(1)
    prompts = {rid: [rng.randrange(3, 200) for _ in range(12)] for rid in ("a0", "a1", "b0")}
    for rid, prompt in prompts.items():
        assert outs[rid] == hf_greedy(eng.hf_model, prompt, 24, frozenset()) == plain_outs[rid], rid


def test_a_tenant_and_its_weight_are_checked(model_dir):
    eng = _engine(model_dir)
    for kw, field in ((dict(tenant=""), "tenant"), (dict(tenant=5), "tenant"),
                      (dict(tenant="t", tenant_weight=0), "tenant_weight"),
                      (dict(tenant="t", tenant_weight=float("nan")), "tenant_weight")):
        with pytest.raises(InvalidRequestError) as exc:
            eng.add_request("x", [5, 6], SamplingParams(max_tokens=2), **kw)
        assert exc.value.field == field
    assert not eng.has_unfinished_requests()


def test_the_suffix_speculators_shared_state_stays_within_its_scope():
    p = SuffixProposer(max_match=4, min_prob=0.3)
    p.finish("done", [50, 51, 52, 53, 54, 55], scope="tenant:alice")
    assert p.propose("b", [1, 2, 50, 51], 3, scope="tenant:alice") == [52, 53, 54]
    assert p.propose("c", [1, 2, 50, 51], 3, scope="tenant:bob") == []
    assert p.propose("d", [1, 2, 50, 51], 3) == []  # unscoped requests learn nothing from alice's either


def _record_steps(eng) -> list[list[tuple[str, int]]]:
    """Each step's (request id, tokens computed) from here on, appended as the engine schedules."""
    steps: list[list[tuple[str, int]]] = []
    schedule = eng.scheduler.schedule

    def record():
        out = schedule()
        steps.append([(c.request.request_id, c.num_new_tokens) for c in out.chunks])
        return out

    eng.scheduler.schedule = record
    return steps


CPU_CAP = HEAVY_PREFILL_BLOCKS * 4  # the default cap on a CPU with 4-token blocks


def test_a_heavier_tenants_prompt_tokens_are_capped_while_a_lighter_one_has_prompt_work(model_dir):
    """The step that starts the innocent's prompt carries none of the flood's prompts (they get at most
    the cap, on a CPU one block: 4 tokens, in the steps around it), not the rest of the budget (64)."""
    eng = _engine(model_dir, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    steps = _record_steps(eng)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rng = random.Random(3)
    for i in range(3):
        eng.add_request(f"a{i}", [rng.randrange(3, 200) for _ in range(100)], params, tenant="flooder")
    eng.step()
    eng.add_request("b0", [40, 41, 42, 43, 44, 45], params, tenant="innocent")
    eng.step()
    with_innocent = dict(steps[-1])
    assert with_innocent.get("b0") == 6
    assert sum(n for rid, n in with_innocent.items() if rid != "b0" and n > 1) == 0
    eng.step()
    assert 0 < sum(n for rid, n in dict(steps[-1]).items() if rid != "b0" and n > 1) <= CPU_CAP
    assert sum(n for rid, n in dict(steps[0]).items()) == 64  # alone, the flood takes the whole budget
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()


def test_a_heavier_tenants_prompt_tokens_are_capped_while_a_lighter_one_decodes(model_dir):
    """The cap holds while the lighter tenant only decodes, and for TENANT_ACTIVE_S after its last request
    went: its next prompt, when it comes, waits for a small step, not a full budget of the flood's prompts;
    with the flood alone after that, no cap."""
    eng = _engine(model_dir, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    now = [1000.0]
    eng.scheduler.clock = lambda: now[0]
    steps = _record_steps(eng)
    rng = random.Random(5)
    eng.add_request("b0", [40, 41, 42, 43], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                    tenant="innocent")
    eng.step()  # its prompt: it decodes from now on
    for i in range(3):
        eng.add_request(f"a{i}", [rng.randrange(3, 200) for _ in range(100)],
                        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), tenant="flooder")
    for _ in range(5):
        eng.step()
        flood = sum(n for rid, n in steps[-1] if rid.startswith("a") and n > 1)
        assert dict(steps[-1]).get("b0") == 1 and flood <= CPU_CAP, steps[-1]
    eng.abort("b0")
    now[0] += TENANT_ACTIVE_S - 0.5
    eng.step()  # the innocent is still active: a closed-loop client's next request may be on its way
    assert sum(n for rid, n in steps[-1] if rid.startswith("a") and n > 1) <= CPU_CAP, steps[-1]
    now[0] += 1.0
    eng.step()
    assert sum(n for rid, n in steps[-1] if rid.startswith("a")) > CPU_CAP  # the flood alone: no cap
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()


def test_the_heavier_tenants_cap_is_a_setting(model_dir):
    eng = _engine(model_dir, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                  tenant_prefill_tokens=20)
    steps = _record_steps(eng)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("b0", [40, 41, 42, 43], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                    tenant="innocent")
    eng.step()
    rng = random.Random(6)
    for i in range(3):
        eng.add_request(f"a{i}", [rng.randrange(3, 200) for _ in range(100)], params, tenant="flooder")
    eng.step()
    assert sum(n for rid, n in steps[-1] if rid.startswith("a") and n > 1) == 20, steps[-1]
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    for bad in (0, -3, True):
        with pytest.raises(EngineConfigError, match="tenant_prefill_tokens"):
            EngineConfig(model=model_dir, tenant_prefill_tokens=bad)


def test_a_lighter_prompt_waiting_on_a_heavier_ones_shared_block_does_not_stop_it(model_dir):
    """The innocent's prompt starts with the same blocks the flood's running prompt is computing: it waits
    for them (shared prefill), so the flood's prompt is not held back for it (or neither would move);
    both finish, and the innocent's output equals transformers'."""
    eng = _engine(model_dir, max_num_seqs=8, max_num_batched_tokens=16)
    steps = _record_steps(eng)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    shared = [random.Random(7).randrange(3, 200) for _ in range(40)]
    eng.add_request("a0", shared + [5] * 40, params, tenant="flooder")
    eng.step()  # 16 of the 40 shared tokens
    eng.add_request("b0", shared + [6, 7], params, tenant="innocent")
    for _ in range(3):
        eng.step()
        assert "b0" not in dict(steps[-1]) and 0 < dict(steps[-1])["a0"] <= CPU_CAP, steps[-1]
    first, outs = _run(eng)
    assert outs["b0"] == hf_greedy(eng.hf_model, shared + [6, 7], 3, frozenset())


_request = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 30), st.integers(1, 6), st.integers(0, 6),
                     st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(_request, min_size=1, max_size=10), max_num_seqs=st.integers(1, 4),
       budget=st.integers(4, 48), blocks=st.integers(12, 40), cap=st.one_of(st.none(), st.integers(1, 8)),
       caching=st.booleans(), heavy_weight=st.sampled_from([1.0, 2.0]))
def test_any_mix_of_tenants_runs_to_the_end(model_dir, requests, max_num_seqs, budget, blocks, cap, caching,
                                            heavy_weight):
    """Whatever the tenants, weights, sizes, arrivals, shared prefixes and limits: every request ends
    within a bounded number of steps (no request holds another's slot or budget for ever: the slot
    preemption, the heavier tenants' cap and the lighter prompt's empty step cannot chase each other)
    and the block pool is whole."""
    eng = _engine(model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                  tenant_prefill_tokens=cap, enable_prefix_caching=caching)
    now = [0.0]
    eng.scheduler.clock = lambda: now[0]
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    weights = {"a": heavy_weight, "b": 1.0, "c": 1.0}
    arrivals = sorted(enumerate(requests), key=lambda x: x[1][3])
    done: set[str] = set()
    for step in range(3000):
        while arrivals and arrivals[0][1][3] <= step:
            i, (tenant, n, max_tokens, _, share) = arrivals.pop(0)
            prompt = (shared if share else []) + [20 + (i * 7 + k) % 150 for k in range(n)]
            eng.add_request(f"{tenant}{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                   ignore_eos=True),
                            tenant=tenant, tenant_weight=weights[tenant])
        if not arrivals and not eng.has_unfinished_requests():
            break
        done.update(o.request_id for o in eng.step() if o.finished)
        now[0] += 0.3
    assert len(done) == len(requests) and not eng.has_unfinished_requests(), (len(done), step)
    eng.check_integrity()
