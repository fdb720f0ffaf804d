"""The cookbook's async RL recipe with inflight samplers against saved-per-step samplers.

Runs ``tinker_cookbook.recipes.math_rl.train.cli_main`` (tinker-cookbook 0.6.1, its arithmetic
environment, ``max_steps_off_policy``) against an in-process ``tinker-serve`` on a random Llama
with the demo model's tokenizer, twice on the same server: as the recipe is (each step saves a
snapshot sampler, ``save_weights_and_get_sampling_client()``), and with that call made
``kind="inflight"`` (the recipe has no switch for it: the benchmark wraps the SDK method). Reports
steps per hour (the recipe's wall time over its steps) and the recipe's logged sampler-trainer KL
(``optim/kl_sample_train_v1`` / ``_v2``, mean over steps), and the server's engine calls.

    python benchmarks/inflight_async_rl.py --steps 6 --groups 4 --group-size 4 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tinker
from tinker_cookbook.recipes.math_rl import train as math_rl
from tinker_cookbook.utils import cost_estimation
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from miles_multilora.config.run import config_from_container
from miles_multilora.models.demo_model import prepare_demo_model
from miles_multilora.tinker.serve import start

KEY = "tml-inflight-bench"


def model_dir(root: Path, hidden: int, layers: int) -> Path:
    """A random Llama with the demo model's tokenizer and vocabulary, saved under ``root``."""
    tokenizer = AutoTokenizer.from_pretrained(prepare_demo_model(os.environ.get("MILES_MULTILORA_CACHE")))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    out = root / "model"
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def run(server: Any, args: argparse.Namespace, log_path: Path, inflight: bool) -> dict[str, float]:
    """One recipe run; the SDK's save_weights_and_get_sampling_client made inflight when asked."""
    real = tinker.TrainingClient.save_weights_and_get_sampling_client

    def inflight_save(self: Any, *a: Any, **kw: Any) -> Any:
        return real(self, *a, **{**kw, "kind": "inflight"})

    if inflight:
        tinker.TrainingClient.save_weights_and_get_sampling_client = inflight_save  # type: ignore[method-assign]
    cli = math_rl.CLIConfig(
        model_name=server.state.base_model, renderer_name="role_colon", lora_rank=8, env="arithmetic",
        group_size=args.group_size, groups_per_batch=args.groups, max_tokens=args.max_tokens,
        learning_rate=args.lr, max_steps=args.steps, eval_every=0, save_every=0, log_path=str(log_path),
        base_url=server.url, behavior_if_log_dir_exists="delete", max_steps_off_policy=args.off_policy,
    )  # fmt: skip
    calls_before = len(server.state.queue.sample_batches)
    started = time.perf_counter()
    try:
        asyncio.run(math_rl.cli_main(cli))
    finally:
        tinker.TrainingClient.save_weights_and_get_sampling_client = real  # type: ignore[method-assign]
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line]
    rows = [r for r in rows if "optim/kl_sample_train_v1" in r]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows if key in r)

    return {
        "steps": len(rows), "wall_s": wall, "steps_per_hour": 3600 * len(rows) / wall,
        "kl_v1": mean("optim/kl_sample_train_v1"), "kl_v2": mean("optim/kl_sample_train_v2"),
        "reward": mean("env/all/reward/total"),
        "engine_calls": len(server.state.queue.sample_batches) - calls_before,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups", type=int, default=4, help="groups per batch")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--off-policy", type=int, default=1, help="max_steps_off_policy")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternated")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="inflight-bench-"))
    key = root / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    cfg = config_from_container({
        "model": {"source": "hf", "hf_path": str(model_dir(root, args.hidden, args.layers))},
        "lora": {"num_slots": 2, "max_rank": 8}, "trainer": {"output_dir": str(root / "out"), "micro_batch_size": 32},
        "tinker": {"port": 0, "api_key_file": str(key), "batch_window_s": 0.02, "reproducible_seed": 0},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    os.environ["TINKER_API_KEY"] = KEY
    cost_estimation._pricing_fetched, cost_estimation._pricing_entries = True, None  # offline
    server = start(cfg)
    try:
        for r in range(args.rounds):
            for mode in ("snapshot", "inflight"):
                out = run(server, args, root / f"{mode}-{r}", mode == "inflight")
                logging.getLogger().handlers.clear()  # the recipe's log handlers, per run
                print(
                    json.dumps({"mode": mode, "round": r, **{k: round(v, 6) for k, v in out.items()}}),
                    flush=True,
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
