"""Exceptions raised by the engine. Everything derives from :class:`EngineError`."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A checkpoint cannot be loaded: unknown architecture, missing tensor, bad shape..."""


class InvalidRequestError(EngineError):
    """A request is malformed: bad sampling parameters, prompt too long, unknown id."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(EngineError):
    """The KV cache cannot hold a request even when it runs alone."""
