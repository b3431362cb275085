"""Stop strings, checked on each request's newest text only (incremental detokenization)."""

from __future__ import annotations

from engine.request import Request


def new_text(tokenizer, req: Request) -> str:
    """The text the newest tokens add, decoding only them and a little context before them (never
    the whole output again). "" while they end inside a multi-byte character."""
    ids = req.output_token_ids
    before = tokenizer.decode(ids[req.detok_prefix:req.detok_read], skip_special_tokens=True)
    text = tokenizer.decode(ids[req.detok_prefix:], skip_special_tokens=True)
    if text.endswith("\ufffd"):
        return ""
    req.detok_prefix, req.detok_read = req.detok_read, len(ids)
    return text[len(before):]


def hit_stop_string(tokenizer, req: Request) -> bool:
    """Whether the newest tokens complete one of the request's stop strings. Grows `req.output_text`
    by their text, cut at the earliest stop string found (then `req.stop_reason` names it)."""
    new = new_text(tokenizer, req)
    if not new:
        return False
    longest = max(len(s) for s in req.params.stop)
    # Only a stop string that ends in the new text can be new.
    window_start = max(0, len(req.output_text) - longest + 1)
    req.output_text += new
    cut = None
    for s in req.params.stop:
        i = req.output_text.find(s, window_start)
        if i != -1 and (cut is None or i < cut):
            cut, req.stop_reason = i, s
    if cut is not None:
        req.output_text = req.output_text[:cut]
    return cut is not None
