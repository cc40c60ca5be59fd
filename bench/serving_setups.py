"""The serving benchmark's setups on two cores: a colocated daemon, a prefill + decode pair, and
vLLM under each of its two CPU bindings.

Every process is started (not waited for) by :func:`launch`, pinned with ``taskset``, in its
own session so that stopping its group also stops what it forked (vLLM's engine process).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from edgeinfer.kernels.cpu_features import native_bf16
from edgeinfer.shared.processes import ChildProcess, free_port, spawn

SETUPS = ("both", "pd", "vllm", "vllm-all")
VLLM_SETUPS = ("vllm", "vllm-all")


def cores() -> tuple[str, str, str]:
    """The first two cores this process may run on: (first, second, both) for taskset."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("the serving comparison needs two cores")
    a, b = str(allowed[0]), str(allowed[1])
    return a, b, f"{a},{b}"


def daemon_cmd(model_dir: Path, core: str, port: int, kv_port: int, *args: str) -> list[str]:
    return [
        "taskset", "-c", core, sys.executable, "-m", "edgeinfer.daemon.main",
        "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--kv-port", str(kv_port), *args,
    ]  # fmt: skip


def vllm_dtype(dtype: str) -> str:
    """The dtype vLLM runs in. Its ``auto`` takes the checkpoint's bfloat16 even on a CPU
    without bf16 dot products, where oneDNN cannot build its bf16 linears and it runs 2-4x
    slower than in float32 (AMD EPYC, AVX2, 8 streams on all cores: 22.6 against 53-84 tok/s),
    so there ``auto`` gives vLLM float32, the choice a user of that host makes and the
    daemon's own."""
    if dtype != "auto" or native_bf16():
        return dtype
    return "float32"


def launch(
    setup: str, model_dir: Path, args: argparse.Namespace
) -> tuple[ChildProcess, list[ChildProcess]]:
    """Spawn ``setup``'s processes without waiting for them; return the API process and all."""
    first, second, both = cores()
    workdir = Path(tempfile.mkdtemp(prefix=f"serving-{setup}-"))
    procs: list[ChildProcess] = []

    def daemon(name: str, core: str, *flags: str) -> ChildProcess:
        # Torch threads: the daemon's own default (one per core it is pinned to).
        port, kv_port = free_port(), free_port()
        env = {"EDGEINFER_HEARTBEAT_PORT": str(free_port())}
        cmd = daemon_cmd(model_dir, core, port, kv_port, "--dtype", args.dtype, *flags)
        url = f"http://127.0.0.1:{port}"
        procs.append(spawn(name, cmd, workdir=workdir, url=url, env=env, ports={"kv": kv_port}))
        return procs[-1]

    if setup == "both":
        api = daemon("both", both, "--role", "both")
    elif setup == "pd":
        prefill = daemon("prefill", first, "--role", "prefill")
        threshold = [] if args.local_prefill_threshold is None else [
            "--local-prefill-threshold", str(args.local_prefill_threshold)]  # fmt: skip
        # The decode daemon's ZeroMQ client reconnects until the prefill daemon listens.
        api = daemon(
            "decode", second, "--role", "decode",
            "--prefill-peer", prefill.tcp_endpoint("kv"), *threshold,
        )  # fmt: skip
    elif setup in VLLM_SETUPS:
        port = free_port()
        cmd = [
            "taskset", "-c", both, args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--dtype", vllm_dtype(args.dtype),
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        if setup == "vllm-all":
            # vLLM's default keeps one of the two cores for its API server and computes on the
            # other; this binding computes on both, as edgeinfer's `both` does. Which of the
            # two is faster depends on the host and the load, so the bench measures both.
            env |= {"VLLM_CPU_OMP_THREADS_BIND": both, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        url = f"http://127.0.0.1:{port}"
        procs.append(spawn(setup, cmd, workdir=workdir, url=url, env=env))
        api = procs[-1]
    else:
        raise ValueError(f"unknown setup {setup!r}")
    return api, procs
