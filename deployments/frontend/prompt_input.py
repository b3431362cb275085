"""One prompt as the client sent it: what the doors build and request preparation and the tool-call
template check read (its own module, so that neither imports the other for it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PromptKind(enum.Enum):
    TEXT = "text"  # a string, tokenized without special tokens
    TOKEN_IDS = "token_ids"  # ids used as they are, bounded by the vocabulary
    CHAT = "chat"  # role/content messages through the model's chat template


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt as the client sent it. `field` is the request field errors about it name."""

    kind: PromptKind
    value: str | list[int] | list[dict[str, str]]
    field: str = "prompt"
    tools: list[dict] | None = None  # chat: the tools the template renders (tool_calls.py); None: none
