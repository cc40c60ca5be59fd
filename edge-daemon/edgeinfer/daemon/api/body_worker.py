"""The body-decoding worker process (:mod:`~edgeinfer.daemon.api.body_decoder` starts it).

    python -m edgeinfer.daemon.api.body_worker BUFFER_PATH

The daemon writes a request body into the shared file ``BUFFER_PATH`` and sends its size on
stdin (8 bytes, little-endian); the worker answers on stdout with the body's shape
(:mod:`~edgeinfer.daemon.api.body_shape`), framed by its length (4 bytes, little-endian).
One byte on stdout says the worker is ready. It exits when stdin closes, which is also what
happens when the daemon dies.

It runs at the lowest priority (``SCHED_IDLE`` where Linux has it, else ``NICE``): a core the
engine or the event loop wants is theirs, and a flood of huge posts then slows only the
refusals. Nice 10 was not enough: traced with ``perf sched`` on a 2-core host under 4 clients
posting 16 MiB prompts, the worker, woken after a long sleep, kept the engine thread's core for
a whole 4 ms tick while that thread waited to run; a normal task preempts an idle-policy one as
soon as it wakes. The worker still runs whenever a core would otherwise idle (the measured
refusals took as long as at nice 10).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys

from edgeinfer.daemon.api.body_shape import encode_shape, shape_of

NICE = 10
READY = b"R"
SIZE = struct.Struct("<Q")
FRAME = struct.Struct("<I")


def main(path: str) -> None:
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    os.nice(NICE)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):  # a sandbox may refuse it: nice 10 then
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(READY)
    stdout.flush()
    with memoryview(buffer) as view:
        while len(head := stdin.read(SIZE.size)) == SIZE.size:
            (size,) = SIZE.unpack(head)
            data = encode_shape(shape_of(view[:size]))
            stdout.write(FRAME.pack(len(data)) + data)
            stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
