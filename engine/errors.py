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


# NOTE: a request that fails in its engine after it was accepted (its grammar did not compile there)
# reaches the door as a RequestOutput's `error` text, across processes; a text made here says "the
# client's fault, name this field", and the door turns it back into an InvalidRequestError (a 400).
_INVALID_PREFIX = "invalid request: "


def invalid_request_text(field: str, message: str) -> str:
    """`RequestOutput.error` for a request refused after it was accepted (`parse_invalid_request`)."""
    return f"{_INVALID_PREFIX}{field}: {message}"


def refusal_text(exc: BaseException) -> str:
    """What a worker sends on about a request its engine refused: an `invalid_request_text` for an
    `InvalidRequestError` (the door answers 400 naming the field), else the exception's own text (the
    door logs that and shows a generic error)."""
    if isinstance(exc, InvalidRequestError):
        return invalid_request_text(exc.field, exc.message)
    return str(exc) or type(exc).__name__


def parse_invalid_request(error: str | None) -> InvalidRequestError | None:
    """The InvalidRequestError an `invalid_request_text` carries; None for any other error text."""
    if not error or not error.startswith(_INVALID_PREFIX):
        return None
    field, _, message = error[len(_INVALID_PREFIX):].partition(": ")
    return InvalidRequestError(field, message) if field and message else None
