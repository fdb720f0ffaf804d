"""Which adapter specs can a base model learn with GRPO? A screen of the base model before training.

GRPO learns only from groups whose rewards differ: a task where the base model never (or always)
earns the reward gives no signal. For each adapter spec this samples the base model (HF
transformers, no adapter) on the spec's own prompts, rendered and scored exactly as a run renders
and scores them (the spec's template, chat template and reward), and prints:

- ``distinct``: distinct training questions among ``dataset.size`` (a small pool is memorised);
- ``held-out``: greedy accuracy on the spec's held-out eval set (what step 0 of a run reports);
- ``reward``: mean reward of ``n_samples_per_prompt`` samples at the spec's temperature on
  ``--prompts`` training prompts, and ``signal``: the share of those groups whose rewards differ.

A spec whose eval set cannot be built (too few distinct items) is reported with the reason. A short
run of the specs that pass (``benchmarks/vs_trl.py --skip-peer``) then shows which ones learn.

    python benchmarks/screen_tasks.py examples/multi_lora/gpu_adapters        # CPU: ~1 s a spec
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data.datasets import load_adapter_dataset
from miles_multilora.data.evaluation import build_held_out
from miles_multilora.data.prompts import render_prompt
from miles_multilora.data.records import RewardSample
from miles_multilora.data.rewards import build_reward
from miles_multilora.errors import SpecError
from miles_multilora.models.demo_model import demo_model_dir


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new: int, temperature: float, n: int) -> list[str]:
    """``n`` completions per prompt (greedy when ``temperature`` is 0), in prompt order."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kwargs = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    out = model.generate(
        **batch, max_new_tokens=max_new, num_return_sequences=n, pad_token_id=tokenizer.pad_token_id, **kwargs
    )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def screen(path: Path, model, tokenizer, prompts: int) -> dict:
    spec = parse_adapter_spec(path)
    train = load_adapter_dataset(spec.dataset)
    reward = build_reward(spec, train)
    row = {"name": spec.name, "task": spec.dataset.task or spec.dataset.path}
    row["distinct"] = len(set(train.questions()))
    max_new = spec.sampling.max_new_tokens
    try:
        held = build_held_out(spec, train, tokenizer)
    except SpecError as exc:
        row["error"] = f"{exc.key}: {exc.message}"
        return row
    texts = generate(model, tokenizer, [i.prompt for i in held.items], max_new, 0.0, 1)
    row["held_out"] = statistics.fmean(
        reward.score(RewardSample.from_item(item, text)).reward
        for item, text in zip(held.items, texts, strict=True)
    )
    rows = [train.row(i) for i in range(min(prompts, len(train)))]
    rendered = [render_prompt(r, spec.prompt, tokenizer) for r in rows]
    n = spec.n_samples_per_prompt
    texts = generate(model, tokenizer, rendered, max_new, spec.sampling.temperature or 1.0, n)
    groups = []
    for k, (r, prompt) in enumerate(zip(rows, rendered, strict=True)):
        samples = [RewardSample(prompt, t, r.answer, r.metadata) for t in texts[k * n : (k + 1) * n]]
        groups.append([reward.score(s).reward for s in samples])
    row["reward"] = statistics.fmean(x for g in groups for x in g)
    row["signal"] = statistics.fmean(float(len(set(g)) > 1) for g in groups)
    row["example"] = texts[0].strip().replace("\n", " ")[:40]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("specs", type=Path, nargs="+", help="adapter spec YAMLs or folders of them")
    parser.add_argument("--hf-path", default=None, help="an HF checkpoint (default: the demo model)")
    parser.add_argument("--prompts", type=int, default=16, help="training prompts sampled per spec")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    files = [f for p in args.specs for f in (sorted(p.glob("*.yaml")) if p.is_dir() else [p])]
    path = args.hf_path or str(demo_model_dir())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    print(
        "| spec | task | distinct | held-out | reward | signal | first sample |\n|---|---|---|---|---|---|---|"
    )
    for f in files:
        r = screen(f, model, tokenizer, args.prompts)
        if "error" in r:
            print(f"| {r['name']} | {r['task']} | {r['distinct']} | {r['error']} | | | |", flush=True)
            continue
        print(
            f"| {r['name']} | {r['task']} | {r['distinct']} | {r['held_out']:.2f} | {r['reward']:.2f} "
            f"| {r['signal']:.2f} | {r['example']!r} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
