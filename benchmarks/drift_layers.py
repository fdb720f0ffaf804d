"""Where the engine's and the trainer's hidden states part, layer by layer, on the same tokens.

Loads the checkpoint of a run config (``model=demo``: SmolLM2-135M-Instruct) without adapters, samples
``--new`` tokens after each of ``--rows`` GSM8K chat prompts with the embedded engine's model
(:class:`~miles_multilora.rollout.paged_model.PagedModel`: each prompt prefilled on its own, as a CPU
engine does, then every row's decode steps together, temperature 1), then runs the trainer's scoring
forward over the same tokens (:func:`~miles_multilora.scoring.logprobs.selected_scores`, the rows
right-padded). Prints the sampled tokens' logprob differences, and for every layer the relative
difference ``|engine - trainer| / |trainer|`` of its attention output (the output projection's input),
its MLP's inner activation (``linear_fc2``'s input) and the residual stream after it, over the prompt
positions (prefill) and the sampled ones (decode). Layer 0 reads the same embeddings on both sides,
so its attention output's difference is the attention kernels' own; later ones carry what came before.
Hooks see the modules only: run it where the decode fusions are off (a CPU), or read the first layers.

    python benchmarks/drift_layers.py --dtype bfloat16 --rows 8 --new 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from miles_multilora.config.run import load_run_config
from miles_multilora.models import compat
from miles_multilora.models.paths import resolve_model_path
from miles_multilora.models.provider import load_hf_model
from miles_multilora.rollout.paged_model import PagedModel
from miles_multilora.scoring.logprobs import selected_scores

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gsm8k_mini.jsonl"
PAGE = 16


def _points(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Name -> the module whose input is recorded."""
    points: dict[str, torch.nn.Module] = {}
    layers = list(model.decoder.layers)
    for i, layer in enumerate(layers):
        points[f"{i} attention"] = layer.self_attention.linear_proj
        points[f"{i} mlp inner"] = layer.mlp.linear_fc2
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
        if after is not None:
            points[f"{i} residual"] = after
    return points


def _record(points: dict[str, torch.nn.Module], seen: dict[str, list[torch.Tensor]]) -> list:
    def hook(name: str):
        return lambda _module, args: seen.setdefault(name, []).append(args[0].detach().float().cpu())

    return [module.register_forward_pre_hook(hook(name)) for name, module in points.items()]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new", type=int, default=64, help="tokens sampled per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", action="append", default=[], help="a hydra override (repeatable)")
    args = parser.parse_args()
    cfg = load_run_config("train", [f"model.dtype={args.dtype}", "adapters=[]", *args.override])
    path = resolve_model_path(cfg)
    if path is None:
        raise SystemExit(f"model.source={cfg.model.source} has no checkpoint: this needs real weights")
    compat.init_distributed()
    loaded = load_hf_model(path, dtype=args.dtype)
    model = loaded.model.eval()
    model.requires_grad_(False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines() if line.strip()]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in questions[: args.rows]
    ]
    rows, device = len(prompts), compat.default_device()
    longest = max(len(p) for p in prompts) + args.new
    paged = PagedModel(model, longest)
    per_row = -(-longest // PAGE)
    cache = paged.new_cache(1 + rows * per_row, PAGE)
    table = torch.arange(1, 1 + rows * per_row, dtype=torch.int32, device=device).view(rows, per_row)
    points = _points(model)
    engine: dict[str, list[torch.Tensor]] = {}
    handles = _record(points, engine)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    logits = torch.cat([
        paged.prefill(cache, torch.tensor([p], device=device), torch.tensor([len(p)], device=device), table[b : b + 1])
        for b, p in enumerate(prompts)
    ])  # fmt: skip
    sequences, sampled = [list(p) for p in prompts], []
    for step in range(args.new):
        logprobs = torch.log_softmax(logits.float(), -1)
        token = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
        sampled.append(logprobs.gather(1, token[:, None])[:, 0].cpu())
        for b in range(rows):
            sequences[b].append(int(token[b]))
        if step + 1 < args.new:
            positions = torch.tensor([len(s) - 1 for s in sequences], device=device)
            logits = paged.decode(cache, token, positions, table)
    for handle in handles:
        handle.remove()
    trainer: dict[str, list[torch.Tensor]] = {}
    handles = _record(points, trainer)
    width = max(len(s) for s in sequences)
    ids = torch.full((rows, width), 0, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.tensor(s)
    row_index = torch.arange(rows).repeat_interleave(args.new)
    positions = torch.tensor(
        [p for s, q in zip(sequences, prompts, strict=True) for p in range(len(q) - 1, len(s) - 1)]
    )
    scored, _, _ = selected_scores(
        model, ids.to(device), [-1] * rows, loaded.vocab_size, row_index.to(device), positions.to(device)
    )
    for handle in handles:
        handle.remove()
    diff = torch.stack(sampled, 1).reshape(-1).double() - scored.cpu().double()
    print(f"{path.name} {args.dtype}: {rows} rows x {args.new} tokens; mean |dlp| {diff.abs().mean():.4f} "
          f"max {diff.abs().max():.3f} kl_v1 {diff.mean():.2e} kl_v2 {(0.5 * diff**2).mean():.2e}")  # fmt: skip
    print(f"{'layer point':>16} {'prefill rel':>12} {'decode rel':>12}")
    for name in points:
        if len(engine.get(name, [])) != rows + args.new - 1:
            continue  # a fused decode kernel ran instead of the module (a GPU)
        prefill_sq = decode_sq = prefill_ref = decode_ref = 0.0
        for b, prompt in enumerate(prompts):
            # the engine's calls: the rows' prefills ([P, 1, H] each), then one [1, rows, H] per step
            got = torch.cat([engine[name][b][:, 0], *(t[0, b : b + 1] for t in engine[name][rows:])])
            want = trainer[name][0][: got.shape[0], b]
            split = len(prompt)
            prefill_sq += (got[:split] - want[:split]).square().sum().item()
            decode_sq += (got[split:] - want[split:]).square().sum().item()
            prefill_ref += want[:split].square().sum().item()
            decode_ref += want[split:].square().sum().item()
        print(
            f"{name:>16} {(prefill_sq / prefill_ref) ** 0.5:12.3e} {(decode_sq / max(decode_ref, 1e-30)) ** 0.5:12.3e}"
        )


if __name__ == "__main__":
    main()
