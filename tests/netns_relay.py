"""A TCP relay that adds a fixed delay: the userspace stand-in for ``tc qdisc ... netem``.

Run in a PoP's namespace on kernels without netem: it listens on ``--listen`` for each of
``--ports`` and connects each accepted connection to the same port on ``--target``. Every chunk
read is held for half of ``--delay-ms`` before it is written on, in each direction, so a
request/response exchange gains one full ``--delay-ms`` round trip. Chunks keep flowing while
earlier ones wait (each is stamped on arrival), so the relay adds latency, not a bandwidth cap.
Connection set-up is not delayed (the relay accepts at once); kept-alive connections, which is
what the router's RTT probes and proxied streams use, see the delay on every exchange.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Awaitable, Callable


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived; EOF likewise."""
    loop = asyncio.get_running_loop()
    held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def stamp() -> None:
        while True:
            chunk = await reader.read(65536)
            held.put_nowait((loop.time() + delay_s, chunk))
            if not chunk:
                return

    stamper = asyncio.create_task(stamp())
    try:
        while True:
            due, chunk = await held.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()  # half-close: the other direction may still be busy
                return
            writer.write(chunk)
            await writer.drain()
    finally:
        stamper.cancel()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def handler(target: str, port: int, delay_s: float) -> Handler:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(target, port)
        except OSError:
            client_w.close()  # the daemon is not up yet: the caller sees a refused exchange
            return
        pumps = [
            asyncio.create_task(pump(client_r, up_w, delay_s)),
            asyncio.create_task(pump(up_r, client_w, delay_s)),
        ]
        try:
            await asyncio.gather(*pumps)
        except OSError:
            pass  # a reset on either side ends the whole connection
        finally:
            for task in pumps:
                task.cancel()
            for w in (up_w, client_w):
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()

    return relay


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--ports", required=True, help="comma-separated")
    parser.add_argument("--delay-ms", type=float, required=True, help="added round trip")
    args = parser.parse_args()
    half = args.delay_ms / 2000
    servers = [
        await asyncio.start_server(handler(args.target, p, half), args.listen, p)
        for p in (int(x) for x in args.ports.split(","))
    ]
    print(f"relaying {args.listen} -> {args.target} ports {args.ports}", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
