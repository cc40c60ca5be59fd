"""``edge-daemon`` whose model load never ends, held where a test wants to stop it.

``EDGEINFER_TEST_HOLD`` says where: ``blocked`` waits in a lock before loading anything (a load
stuck on a slow disk or download), ``torch`` loads the model and then keeps the engine thread in
torch's kernels for good (the state in which an interpreter exit used to crash the process).
The load writes ``EDGEINFER_TEST_HOLD_MARKER`` once it is held, so the test stops it then.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from edgeinfer.daemon import app
from edgeinfer.daemon.engine.config import EngineConfig
from edgeinfer.daemon.engine.llm_engine import LLMEngine
from edgeinfer.daemon.main import main


class HeldEngine(LLMEngine):
    def __init__(self, config: EngineConfig | None = None) -> None:
        hold, marker = os.environ["EDGEINFER_TEST_HOLD"], os.environ["EDGEINFER_TEST_HOLD_MARKER"]
        if hold == "blocked":
            Path(marker).write_text(hold)
            threading.Event().wait()
        super().__init__(config)
        a = torch.randn(256, 256)
        Path(marker).write_text(hold)
        while True:
            a = torch.tanh(a @ a)


app.LLMEngine = HeldEngine  # type: ignore[misc]  # what app._load builds

if __name__ == "__main__":
    main()
