"""Errors a user can cause. Each names the offending field so the HTTP edge can map it to a 400."""


class InvalidRequestError(ValueError):
    """A request parameter is invalid. `field` names it (OpenAI's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context or the KV pool."""


class EngineConfigError(ValueError):
    """An engine setting is invalid; the message says what to fix."""
