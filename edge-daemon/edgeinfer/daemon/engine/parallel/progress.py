"""Loading progress of every rank, counted in the engine's TCPStore and shown by rank 0.

Each rank adds its tensor count to ``load/total`` before it starts and ``1`` to ``load/done``
per tensor, so rank 0 can show one bar for all ranks (or log when they are done) while it waits.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch.distributed import Store

log = logging.getLogger(__name__)

_TOTAL, _DONE, _RANKS = "load/total", "load/done", "load/ranks"


class StoreProgress:
    def __init__(self, store: Store) -> None:
        self.store = store

    def start(self, num_tensors: int) -> None:
        self.store.add(_TOTAL, num_tensors)
        self.store.add(_RANKS, 1)

    def tick(self) -> None:
        self.store.add(_DONE, 1)

    def counts(self) -> tuple[int, int, int]:
        """``(done, total so far, ranks started)``: adding 0 reads a counter."""
        return self.store.add(_DONE, 0), self.store.add(_TOTAL, 0), self.store.add(_RANKS, 0)


class LoadDisplay(StoreProgress):
    """Rank 0's progress: a bar on a terminal, a log line per quarter otherwise."""

    def __init__(self, store: Store, world_size: int, show: bool | None) -> None:
        super().__init__(store)
        self.world_size = world_size
        self._bar: Any = None
        self._logged = 0
        if show if show is not None else sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.add_task(f"Loading weights ({world_size} ranks)", total=None)
            self._bar.start()

    def tick(self) -> None:
        super().tick()
        self.refresh()

    def refresh(self) -> None:
        done, total, ranks = self.counts()
        if ranks < self.world_size:
            total = 0  # not every rank has counted its tensors yet
        if self._bar is not None:
            self._bar.update(self._bar.task_ids[0], completed=done, total=total or None)
        elif total and done * 4 >= total * (self._logged + 1):
            self._logged = done * 4 // total
            log.info("loading weights on %d ranks: %d/%d tensors", self.world_size, done, total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
