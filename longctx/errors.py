"""Errors longctx raises on purpose; the CLI turns each into one readable line."""


class LongCtxError(Exception):
    """Base of the errors that longctx raises deliberately."""


class CacheFullError(LongCtxError):
    """The pools cannot take the tokens asked for. Nothing already cached was lost.

    `tokens_that_fit` is how many more tokens each row can still take.
    """

    def __init__(self, message: str, tokens_that_fit: int = 0):
        super().__init__(message)
        self.tokens_that_fit = tokens_that_fit


class UnsupportedModelError(LongCtxError, ValueError):
    """The model has layers the paged cache cannot serve (sliding window, hybrid, ...)."""


class BackendUnavailableError(LongCtxError, RuntimeError):
    """The attention backend asked for cannot serve this request; the message says why."""


class SharedMemoryError(BackendUnavailableError):
    """A Triton kernel needs more shared memory a block than the GPU allows, even in one stage."""


class ModelNotFoundError(LongCtxError, FileNotFoundError):
    """A model could not be found; the message says where we looked and what to install."""
