"""Tensor and pipeline parallelism for the engine, applied to the plain model after it is built.

``tp * pp`` ranks, one process each: rank 0 is the driver inside the engine's own thread, the
others are spawned workers (:mod:`worker`). :mod:`layout` says what each rank owns, :mod:`tp`
shards the modules and loads only the rank's slices, :mod:`pp` runs micro-batches through the
stages, :mod:`executor` is the ``ModelRunner``-compatible front that :class:`LLMEngine` uses.
"""
