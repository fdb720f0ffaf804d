"""How far the engine's sampling logprobs are from the trainer's on the same tokens, on real weights.

Builds one trainer rank as a run does (``model=demo``: SmolLM2-135M-Instruct; ``--override`` for any
other setting, e.g. ``model.base_precision=fp8``), samples ``--samples`` completions of each of
``--prompts`` chat prompts (GSM8K questions) with the base model (slot -1) at temperature 1 on the embedded engine, then
rescores the same tokens with the trainer's forward. Prints, over the sampled tokens, the mean, 99th
percentile and largest |sampler logprob - trainer logprob| and the tinker-cookbook's sampler-trainer KL
estimates (``kl_sample_train_v1`` = mean(sampler - trainer), ``_v2`` = mean((sampler - trainer)^2) / 2),
the numbers the training metrics report per adapter (``algo.losses.sampler_drift``).

    python benchmarks/sampler_drift.py                          # CPU: fp32 activations
    python benchmarks/sampler_drift.py --dtype bfloat16         # bf16 (a GPU's default)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.config.run import load_run_config
from miles_multilora.rollout.types import GenerationRequest
from miles_multilora.trainer.auto_slots import sized_config
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gsm8k_mini.jsonl"


def questions(path: Path, count: int) -> list[str]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["question"] for r in lines[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--data", type=Path, default=DATA, help="GSM8K-format JSONL: its questions")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--override", action="append", default=[], help="a hydra override (repeatable)")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    rows = args.prompts * args.samples
    overrides = [f"model.dtype={dtype}", "adapters=[]", "lora.num_slots=1", f"rollout.max_batch_size={rows}"]
    mine = {o.split("=", 1)[0] for o in args.override}
    cfg = load_run_config("train", [o for o in overrides if o.split("=", 1)[0] not in mine] + args.override)
    rank = TrainerRank(sized_config(cfg))
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=args.max_new)
    prompts = [rank.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in questions(args.data, args.prompts)]  # fmt: skip
    groups = [
        [GenerationRequest.for_base(ids, sampling, seed=1000 * p + s) for s in range(args.samples)]
        for p, ids in enumerate(prompts)
    ]
    start = time.perf_counter()
    outcomes = rank.sample(groups)
    sample_s = time.perf_counter() - start
    scored, sampler = [], []
    for ids, outcome in zip(prompts, outcomes, strict=True):
        if isinstance(outcome, Exception):
            raise outcome
        for result in outcome:
            tokens = list(ids) + list(result.output_ids)
            positions = list(range(len(ids) - 1, len(tokens) - 1))
            scored.append(ScoredRow(-1, tokens, positions, temperature=1.0))
            sampler.append(torch.tensor(result.logprobs, dtype=torch.float64))
    trainer = [torch.tensor(s.logprobs, dtype=torch.float64) for s in rank.score(scored)]
    diff = torch.cat(sampler) - torch.cat(trainer)
    absolute = diff.abs()
    print(f"model {cfg.model.source} dtype {dtype} base {cfg.model.base_precision}; "
          f"{len(scored)} samples, {diff.numel()} tokens, sampled in {sample_s:.1f} s")  # fmt: skip
    print(f"{'mean |dlp|':>12} {'p99 |dlp|':>12} {'max |dlp|':>12} {'kl_v1':>12} {'kl_v2':>12}")
    print(f"{absolute.mean():12.3e} {absolute.quantile(0.99):12.3e} {absolute.max():12.3e} "
          f"{diff.mean():12.3e} {(0.5 * diff**2).mean():12.3e}")  # fmt: skip


if __name__ == "__main__":
    main()
