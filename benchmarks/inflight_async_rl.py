"""The cookbook's async RL with inflight samplers against saved-per-step samplers.

Runs the cookbook's RL trainer (``tinker_cookbook.rl.train.main``, tinker-cookbook 0.6.1, its
async mode: ``AsyncConfig(max_steps_off_policy=...)``, its default loss ``stable_reinforce``, as
the math RL recipe sets it) against an in-process ``tinker-serve`` on a random Llama with the
demo model's tokenizer. The environment rewards a response of an even number of characters, so
a group's rewards differ and the weights move (the math recipe's arithmetic environment gives a
random model the same format penalty on every sample: no gradient, a KL of exactly 0). Two modes
on the same server, alternated: as the trainer is (each step saves a snapshot sampler,
``save_weights_and_get_sampling_client()``), and with that call made ``kind="inflight"`` (the
trainer has no switch for it: the benchmark wraps the SDK method). Reports steps per hour (the
trainer's wall time over its steps), the trainer's logged sampler-trainer KL
(``optim/kl_sample_train_v1`` / ``_v2``, mean over steps) and the server's engine calls.

    python benchmarks/inflight_async_rl.py --steps 6 --groups 4 --group-size 4 --max-tokens 24
    python benchmarks/inflight_async_rl.py --model demo --lr 1e-4 --rounds 2   # real weights (a GPU)
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
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer
from tinker_cookbook.utils import cost_estimation
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from miles_multilora.config.run import config_from_container
from miles_multilora.models.demo_model import prepare_demo_model
from miles_multilora.tinker.serve import start

KEY = "tml-inflight-bench"
RENDERER = "role_colon"


class EvenLength(ProblemEnv):
    """Reward 1 for a response of an even number of characters (about half of a random model's)."""

    def get_question(self) -> str:
        return "Say something."

    def check_answer(self, sample_str: str) -> bool:
        return len(sample_str) % 2 == 0

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "an even number of characters"


class Prompts(RLDataset):
    def __init__(self, renderer: renderers.Renderer, groups: int, group_size: int, batches: int) -> None:
        self.renderer, self.groups, self.group_size, self.batches = renderer, groups, group_size, batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        env = partial(EvenLength, self.renderer)
        return [ProblemGroupBuilder(env_thunk=env, num_envs=self.group_size) for _ in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class PromptsBuilder(RLDatasetBuilder):
    model_name: str
    groups: int
    group_size: int
    batches: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        return Prompts(renderer, self.groups, self.group_size, self.batches), None


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


def base_model(root: Path, args: argparse.Namespace) -> Path:
    """The served base's HF directory: the demo checkpoint, or a random Llama (``--model``)."""
    if args.model == "demo":
        return prepare_demo_model(os.environ.get("MILES_MULTILORA_CACHE"))
    return model_dir(root, args.hidden, args.layers)


def run(server: Any, args: argparse.Namespace, log_path: Path, inflight: bool) -> dict[str, float]:
    """One trainer run; the SDK's save_weights_and_get_sampling_client made inflight when asked."""
    real = tinker.TrainingClient.save_weights_and_get_sampling_client

    def inflight_save(self: Any, *a: Any, **kw: Any) -> Any:
        return real(self, *a, **{**kw, "kind": "inflight"})

    if inflight:
        tinker.TrainingClient.save_weights_and_get_sampling_client = inflight_save  # type: ignore[method-assign]
    model = server.state.base_model
    config = rl_train.Config(
        log_path=str(log_path), recipe_name="inflight_bench", model_name=model, renderer_name=RENDERER, base_url=server.url, lora_rank=8,
        dataset_builder=PromptsBuilder(model_name=model, groups=args.groups, group_size=args.group_size,
                                       batches=args.steps),
        learning_rate=args.lr, max_tokens=args.max_tokens, eval_every=0, save_every=0, num_groups_to_log=0,
        rollout_json_export=False, loss_fn="stable_reinforce", max_steps=args.steps,
        async_config=rl_train.AsyncConfig(max_steps_off_policy=args.off_policy, groups_per_batch=args.groups,
                                          loss_fn="stable_reinforce"),
    )  # fmt: skip
    calls_before = len(server.state.queue.sample_batches)
    started = time.perf_counter()
    try:
        asyncio.run(rl_train.main(config))
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
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--off-policy", type=int, default=1, help="max_steps_off_policy")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternated")
    p.add_argument(
        "--model",
        choices=("random", "demo"),
        default="random",
        help="random: a random Llama of --hidden/--layers; demo: the demo checkpoint (real weights: "
        "take a learning rate of ~1e-4)",
    )
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="inflight-bench-"))
    key = root / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    cfg = config_from_container({
        "model": {"source": "hf", "hf_path": str(base_model(root, args))},
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
                logging.getLogger().handlers.clear()  # the trainer's log handlers, per run
                print(
                    json.dumps({"mode": mode, "round": r, **{k: round(v, 6) for k, v in out.items()}}),
                    flush=True,
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
