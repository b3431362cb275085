"""Which top-level request fields the HTTP door takes: nothing is ever accepted and ignored.

A field of a request body is one of three kinds:
- implemented: a field of the pydantic request model (openai_protocol.py), checked and used;
- known but not implemented: listed in NOT_IMPLEMENTED with the values that mean "off" (clients and
  SDKs often send defaults, e.g. `presence_penalty: 0`); those values, or null, are accepted and
  dropped, any other value is a 400 naming the field (code `unsupported_parameter`);
- anything else: a 400 naming the field (code `unknown_parameter`). OpenAI ignores unknown fields
  and vLLM only warns; here a typo (`max_token`) or an extension this server lacks is never silently
  dropped.

Harmless fields accepted as they are (openai_protocol.py): `user` and `metadata` (labels that change
nothing about the output; not stored), `stream_options.include_usage`.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from deployments.frontend.openai_protocol import APIError

# field -> the values that mean "off" (null always does). Both endpoints share the table; a field
# only one endpoint defines at OpenAI (e.g. `echo`) is refused the same way by the other.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # OpenAI sampling and output options (`top_logprobs` is chat's, `echo` completions': implemented
    # there, refused unless off at the other endpoint)
    "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,),
    # tools are chat's (tool_calls.py): the completions endpoint takes them only when off
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "functions": ([],), "function_call": ("none",), "store": (False,), "service_tier": ("auto", "default"),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (), "web_search_options": (),
    "prompt_cache_key": (), "safety_identifier": (), "verbosity": (),
    # vLLM's extensions
    "length_penalty": (1,), "use_beam_search": (False,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (), "bad_words": ([],), "allowed_token_ids": (), "truncate_prompt_tokens": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,), "detokenize": (True,),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "chat_template": (), "chat_template_kwargs": ({},),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "documents": (), "request_id": (),
}

MAX_NAME_CHARS = 64  # a field name longer than this is cut in the error


def _same(value: Any, noop: Any) -> bool:
    # NOTE: JSON's true is not 1 and false is not 0 here (Python's == says they are).
    if isinstance(value, bool) != isinstance(noop, bool):
        return False
    if isinstance(value, (list, dict)) != isinstance(noop, (list, dict)):
        return False
    return value == noop


def _shown(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."


def drop_off_fields(data: dict[str, Any], implemented: Iterable[str]) -> dict[str, Any]:
    """`data` without the not-implemented fields that are off; APIError(400) for any other field
    that is not `implemented`."""
    implemented = set(implemented)
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name in implemented:
            out[name] = value
        elif name in NOT_IMPLEMENTED:
            if value is not None and not any(_same(value, noop) for noop in NOT_IMPLEMENTED[name]):
                offs = ", ".join(json.dumps(v) for v in (None, *NOT_IMPLEMENTED[name]))
                raise APIError.bad_request(f"{name}: not supported by this server (accepted only when off: {offs})",
                                           name, "unsupported_parameter")
        else:
            raise APIError.bad_request(f"{_shown(name)}: unknown parameter; this server does not implement it",
                                       _shown(name), "unknown_parameter")
    return out
