"""KV-page transfer benchmark (not a test): ZeroMQ with the edgeinfer framing vs. plain TCP.

A sender process holds the bf16 KV pages of one prompt for a Llama-3-8B-like model (32 layers,
8 KV heads, head_dim 128, 16-token blocks) and streams them to this (receiver) process over
loopback, both ways in the same run, alternating, on the same bytes:

* zmq: ROUTER -> DEALER, one ``kv`` message per (block run x layer group) chunk as the prefill
  server builds them, payloads sent zero-copy from the tensors; the receiver validates every
  message with ``decode`` (header and payload CRC-32) and views each page as a bf16 tensor.
* tcp: ``socket.sendall`` of the same payload buffers, ``recv_into`` one preallocated buffer.

Prints GB/s per transport and the ratio; writes bench/results/kv_transfer.json.

    .venv/bin/python bench/kv_transfer.py [--tokens 4096] [--reps 5] [--chunk-mib 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import zmq
from isal.isal_zlib import crc32

from edgeinfer.daemon.kv_transfer.messages import FirstToken, KVChunk, Ping, WireLayout
from edgeinfer.daemon.kv_transfer.tensor_codec import page_bytes, payload_tensor, tensor_payload
from edgeinfer.daemon.kv_transfer.transport import tune_socket
from edgeinfer.daemon.kv_transfer.wire import DEFAULT_LIMITS, decode, encode
from edgeinfer.shared.processes import free_port

LAYOUT = WireLayout("bfloat16", block_size=16, num_layers=32, num_kv_heads=8, head_dim=128)
RESULTS = Path(__file__).parent / "results" / "kv_transfer.json"
Plan = list[tuple[int, int, int, int]]  # chunks as (first block, end block, first layer, end)


def chunk_plan(num_blocks: int, chunk_bytes: int) -> Plan:
    """The same split as the prefill server's pusher: ~chunk_bytes per message."""
    pair = 2 * page_bytes(LAYOUT)
    blocks_per = max(1, min(num_blocks, chunk_bytes // pair))
    plan = []
    for b0 in range(0, num_blocks, blocks_per):
        b1 = min(num_blocks, b0 + blocks_per)
        layers_per = max(1, chunk_bytes // (pair * (b1 - b0)))
        for l0 in range(0, LAYOUT.num_layers, layers_per):
            plan.append((b0, b1, l0, min(LAYOUT.num_layers, l0 + layers_per)))
    return plan


def sender(
    transport: str, port: int, num_blocks: int, chunk_bytes: int, reps: int, ready: Any
) -> None:
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    # Per layer K and V pages [n, bs, Hkv, D], as export_kv returns them.
    pages = [
        (torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
        for _ in range(LAYOUT.num_layers)
    ]
    plan = chunk_plan(num_blocks, chunk_bytes)
    if transport == "zmq":
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        tune_socket(router, DEFAULT_LIMITS)
        router.bind(f"tcp://127.0.0.1:{port}")
        ready.set()
        for _ in range(reps):
            identity, *_ = router.recv_multipart()
            for seq, (b0, b1, l0, l1) in enumerate(plan):
                parts = [t[b0:b1] for layer in range(l0, l1) for t in pages[layer]]
                chunk = KVChunk(
                    "bench",
                    seq,
                    (l0, l1),
                    tuple(range(b0, b1)),
                    "bfloat16",
                    tuple(tuple(p.shape) for p in parts),
                    tuple(tensor_payload(p) for p in parts),
                )
                router.send_multipart([identity, *encode(chunk)], copy=False)
            router.send_multipart(
                [identity, *encode(FirstToken("bench", 0, 1, None, (), 1, False))]
            )
        router.recv_multipart()  # the receiver's goodbye: everything was read
        router.close()
        ctx.term()
        return
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        conn, _ = server.accept()
        with conn:
            for _ in range(reps):
                conn.recv(1)
                for b0, b1, l0, l1 in plan:
                    for layer in range(l0, l1):
                        for t in pages[layer]:
                            conn.sendall(tensor_payload(t[b0:b1]))
            conn.recv(1)


def receive_zmq(dealer: zmq.Socket[bytes]) -> int:
    dealer.send_multipart(encode(Ping("", 0)))
    received = 0
    while True:
        msg = decode(dealer.recv_multipart(copy=False))
        if isinstance(msg, FirstToken):
            return received
        if isinstance(msg, KVChunk):
            for buf, shape in zip(msg.frames, msg.shapes):
                received += payload_tensor(buf, msg.dtype, shape).numel() * 2


def receive_tcp(conn: socket.socket, buf: bytearray) -> int:
    conn.sendall(b"g")
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n
    return got


def run(transport: str, num_blocks: int, chunk_bytes: int, reps: int) -> list[float]:
    """GB/s of each repetition (the first, a warm-up, is dropped)."""
    port = free_port()
    spawn = mp.get_context("spawn")  # no fork: torch's thread pools do not survive it
    ready = spawn.Event()
    proc = spawn.Process(
        target=sender, args=(transport, port, num_blocks, chunk_bytes, reps + 1, ready)
    )
    proc.start()
    if not ready.wait(120):
        raise RuntimeError("the sender process did not start")
    total = num_blocks * LAYOUT.num_layers * 2 * page_bytes(LAYOUT)
    rates = []
    if transport == "zmq":
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        tune_socket(dealer, DEFAULT_LIMITS)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(reps + 1):
            start = time.perf_counter()
            if receive_zmq(dealer) != total:
                raise RuntimeError("zmq: byte count mismatch")
            rates.append(total / (time.perf_counter() - start) / 1e9)
        dealer.send(b"bye")
        dealer.close(linger=1000)
        ctx.term()
    else:
        buf = bytearray(total)
        with socket.create_connection(("127.0.0.1", port)) as conn:
            for _ in range(reps + 1):
                start = time.perf_counter()
                receive_tcp(conn, buf)
                rates.append(total / (time.perf_counter() - start) / 1e9)
            conn.sendall(b"x")
    proc.join()
    return rates[1:]


def crc32_gbps() -> float:
    """Single-thread CRC-32 speed (ISA-L, as the wire uses): the framing's CPU cost per side."""
    buf = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy()
    start = time.perf_counter()
    for _ in range(4):
        crc32(buf.data)
    return 4 * buf.nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--reps", type=int, default=4, help="timed repetitions per round")
    parser.add_argument("--rounds", type=int, default=3, help="tcp/zmq alternations")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="target bytes per message")
    args = parser.parse_args()
    num_blocks = -(-args.tokens // LAYOUT.block_size)
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    total = num_blocks * LAYOUT.num_layers * 2 * page_bytes(LAYOUT)
    rates: dict[str, list[float]] = {"zmq": [], "tcp": []}
    for _ in range(args.rounds):
        for transport in ("tcp", "zmq"):
            rates[transport] += run(transport, num_blocks, chunk_bytes, args.reps)
    summary = {t: statistics.median(r) for t, r in rates.items()}
    ratio = summary["zmq"] / summary["tcp"]
    print(f"{total / 2**20:.0f} MiB per transfer, {len(chunk_plan(num_blocks, chunk_bytes))} msgs")
    for t in ("tcp", "zmq"):
        print(f"{t:4s} median {summary[t]:6.2f} GB/s   best {max(rates[t]):6.2f} GB/s")
    print(f"zmq / tcp = {ratio:.2f}x (target >= 0.8x)")
    crc = crc32_gbps()
    print(f"crc32 (isal) {crc:.2f} GB/s per thread (paid by sender and receiver)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": {
            "torch": torch.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "layout": dataclasses.asdict(LAYOUT),
            "tokens": args.tokens,
            "bytes_per_transfer": total,
            "chunk_bytes": chunk_bytes,
            "messages_per_transfer": len(chunk_plan(num_blocks, chunk_bytes)),
        },
        "gbps": rates,
        "median_gbps": summary,
        "zmq_over_tcp": ratio,
        "crc32_gbps": crc,
    }
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
