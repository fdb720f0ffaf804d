"""An RL loop written against the official tinker SDK, run against `miles-multilora tinker-serve`.

Each step: snapshot the weights for sampling, sample a group per prompt, score every sample,
turn the scores into per-token advantages, `forward_backward` with `importance_sampling`, then
`optim_step`. The reward here is a token-level toy (the share of even token ids) so that the loop
runs on any model, the tiny test model included; put your own `reward(prompt, tokens)` in its place.

    miles-multilora tinker-serve model=tiny tinker.api_key_file=~/.tinker_key &
    python examples/tinker/rl_loop.py --base-url http://127.0.0.1:8500 --api-key-file ~/.tinker_key
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tinker


def first_key(path: str) -> str:
    """The first key of a key file (one key per line; blank lines and # comments skipped)."""
    lines = Path(path).expanduser().read_text().splitlines()
    return next(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))


def reward(prompt: list[int], tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> tinker.Datum:
    """Score the sampled tokens only: prompt positions get advantage 0."""
    full = prompt + tokens
    pad = len(prompt) - 1
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(full[1:], np.int64)),
            "logprobs": tinker.TensorData.from_numpy(np.asarray([0.0] * pad + logprobs, np.float32)),
            "advantages": tinker.TensorData.from_numpy(
                np.asarray([0.0] * pad + [advantage] * len(tokens), np.float32)
            ),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8500")
    parser.add_argument("--api-key-file", required=True)
    parser.add_argument("--base-model", default="tiny")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--group", type=int, default=16, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()
    prompts = [[5, 17, 33, 9], [60, 2, 44, 71], [8, 19, 90, 3]]
    service = tinker.ServiceClient(base_url=args.base_url, api_key=first_key(args.api_key_file))
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank).result()
    params = tinker.SamplingParams(max_tokens=16, temperature=1.0)
    for step in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        futures = [
            sampler.sample(tinker.ModelInput.from_ints(p), num_samples=args.group, sampling_params=params)
            for p in prompts
        ]
        data, means = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            seqs = future.result().sequences
            scores = np.asarray([reward(prompt, list(s.tokens)) for s in seqs])
            advantages = (scores - scores.mean()) / (scores.std() + 1e-6)  # GRPO: within the group
            means.append(float(scores.mean()))
            data += [
                datum(prompt, list(s.tokens), list(s.logprobs), float(a))
                for s, a in zip(seqs, advantages, strict=True)
            ]
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(tinker.AdamParams(learning_rate=args.lr)).result()
        print(f"step {step + 1}: reward {np.mean(means):.3f}")
    service.close("success")


if __name__ == "__main__":
    main()
