"""How far an FP8 base (``model.base_precision=fp8``) moves a real model's logprobs.

Builds the model as a run does (``model=demo``: SmolLM2-135M-Instruct, converted by provision.sh; or
``--hf-path`` for another checkpoint) with no adapter in its slots, and scores the same texts (the
question and answer of each line of ``--data``, a GSM8K-format JSONL) with the base GEMMs in the
model's dtype and on the FP8 copies. Prints the mean negative log-likelihood per token under both,
and the mean, 99th-percentile and largest absolute logprob difference per token.

    python benchmarks/fp8_drift.py                      # CPU, the demo model, fp32 activations
    python benchmarks/fp8_drift.py --dtype bfloat16     # on a GPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from miles_multilora.config.run import config_from_container
from miles_multilora.lora.inject import multi_lora_layers, use_fp8_base
from miles_multilora.models.compat import init_distributed
from miles_multilora.scoring.logprobs import compute_logprobs
from miles_multilora.trainer.model_build import build_model

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gsm8k_mini.jsonl"


def texts(path: Path, count: int) -> list[str]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in lines[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf-path", default=None, help="an HF checkpoint (default: the demo model)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--rows", type=int, default=32)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    model_cfg = {"source": "hf", "hf_path": args.hf_path} if args.hf_path else {"source": "demo"}
    cfg = config_from_container(
        {"model": {**model_cfg, "dtype": dtype}, "lora": {"num_slots": 1, "max_rank": 8}}
    )
    init_distributed()
    built = build_model(cfg)
    model = built.model.eval()
    sequences = [built.tokenizer.encode(t) for t in texts(args.data, args.rows)]
    slots = [-1] * len(sequences)  # the base model: every LoRA term off
    scores = {}
    for precision in ("dtype", "fp8"):
        if precision == "fp8":
            use_fp8_base(model)
        with torch.no_grad():
            scores[precision] = torch.cat(
                compute_logprobs(model, sequences, slots, 1.0, vocab_size=built.vocab_size)
            ).float()
    for layer in multi_lora_layers(model):
        layer.set_fp8_base(False)
    diff = (scores["fp8"] - scores["dtype"]).abs()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = args.hf_path or "the demo model (SmolLM2-135M-Instruct)"
    print(f"{name}, {dtype} activations, on {device}: {len(sequences)} texts, {diff.numel()} scored tokens")
    print(
        f"  mean NLL per token: base in {dtype} {-scores['dtype'].mean():.4f}, FP8 base {-scores['fp8'].mean():.4f}"
    )
    print(
        f"  |logprob difference| per token: mean {diff.mean():.4f}, p99 {diff.quantile(0.99):.4f}, "
        f"max {diff.max():.4f}"
    )


if __name__ == "__main__":
    main()
