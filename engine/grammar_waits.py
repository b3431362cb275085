"""How long each structured request waited for its grammar, for whoever traces requests.

The engine knows nothing of traces. While a `GrammarWaitLog` is attached (`LLMEngine.watch_grammar_waits`),
it notes one `GrammarWait` per request with an output constraint when that request's wait ends: its
grammar was ready (admitted into the scheduler), failed to compile, ran past its time budget, or the
request was aborted while it waited. The serving layer that owns the engine drains the log after each
step (`take`) and turns each wait into a `grammar.compile` span under the request's trace
(deployments/cluster/traces.py, deployments/frontend/backend.py). Without a log nothing is noted.

    add_request ─▶ admit_with_grammar ─┬─ compiled already (cache hit) or known to fail ─▶ note at once
                                       └─ parked ─┬─ step: _admit_compiled (ready / failed / too slow) ─▶ note
                                                  └─ abort ─▶ note ("aborted")
"""

from __future__ import annotations

import collections
from typing import NamedTuple

MAX_WAITS = 4096  # a log nobody drains keeps the newest this many


class GrammarWait(NamedTuple):
    """One request's wait for its grammar. Times are `time.time()` seconds (the span's clock)."""

    request_id: str
    kind: str  # the spec's kind: json_object, json_schema, regex, choice, grammar
    cache_hit: bool  # the compiled grammar (or a remembered failure) was there at once: nothing compiled for it
    start_time: float  # the request began waiting
    end_time: float  # the engine admitted it, or ended it
    queue_s: float | None  # its compile waited this long for a compile thread (None: nothing compiled)
    compile_s: float | None  # the compile itself on that thread (None: nothing compiled, or not finished)
    error_cause: str | None  # None: admitted; else "invalid", "timeout", "known_invalid" or "aborted"
    error: str | None  # what the request was told (the message naming its field), or None


class GrammarWaitLog:
    """A bounded log of `GrammarWait`s; `note` and `take` may run on different threads."""

    def __init__(self, max_waits: int = MAX_WAITS):
        self._waits: collections.deque[GrammarWait] = collections.deque(maxlen=max_waits)

    def note(self, wait: GrammarWait) -> None:
        self._waits.append(wait)

    def take(self) -> list[GrammarWait]:
        """The waits noted since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._waits.popleft())  # NOTE: popleft is atomic: no lock against `note`
            except IndexError:
                return out
