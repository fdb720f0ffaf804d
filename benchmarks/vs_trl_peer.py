"""The peer of ``benchmarks/vs_trl.py``: one adapter trained with TRL's ``GRPOTrainer`` and PEFT LoRA,
as a user without this project would, on the same prompts, reward and held-out items as ours.

The prompts: the ones our data source draws for the spec, in the order it draws them (TRL's
dataset shuffle off), as the chat our data path renders (TRL applies the same chat template), so
TRL generates from the same token ids (checked for every prompt before training). The reward: the
spec's own, through a :class:`~miles_multilora.data.RewardManager` (the scorer our RL step uses).
The held-out eval: our eval set of the spec, greedy, scored the same way, at step 0, every
``eval.every`` steps and at the end, by a ``TrainerCallback``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.config.lora_targets import FAMILIES
from miles_multilora.data import MultiLoRADataSource, RewardManager, RewardSample
from miles_multilora.data.evaluation import HeldOutSet, build_held_out, eval_metrics
from miles_multilora.data.prompts import chat_messages, fill_template, has_chat_template
from miles_multilora.data.records import PromptItem
from miles_multilora.trainer.tokenizer import encode_prompt

# our LoRA targets (Megatron's fused layers) as the Llama projections PEFT wraps
PEFT_TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],  # linear_qkv, linear_proj
    "mlp": ["gate_proj", "up_proj", "down_proj"],  # linear_fc1 (gate + up), linear_fc2
    "unembed": ["lm_head"],  # output_layer
}


@dataclass
class PeerPrompts:
    """A spec's training prompts for TRL: dataset rows (``prompt``, ``uid``) in our draw order, and
    our prompt items by uid (their reward needs the answer and metadata)."""

    rows: list[dict[str, Any]]
    dataset: Any  # the spec's training dataset (its reward may need it)
    items: dict[str, PromptItem] = field(default_factory=dict)


def peer_prompts(spec: AdapterSpec, tokenizer: Any, count: int) -> PeerPrompts:
    """The first ``count`` prompts our data source draws for ``spec`` (epochs wrap as ours do).
    A prompt our data path renders with the chat template is given to TRL as that chat (TRL applies
    the tokenizer's template itself); otherwise as the rendered text."""
    data = MultiLoRADataSource(tokenizer=tokenizer)
    data.add_adapter(spec)
    dataset = data.dataset(spec.name)
    chat = spec.prompt.use_chat_template and has_chat_template(tokenizer)
    out = PeerPrompts([], dataset)
    while len(out.rows) < count:
        batch = data.next_batch([spec.name]).get(spec.name)
        if not batch:
            raise ValueError(
                f"adapter {spec.name!r}: its data ran out after {len(out.rows)} of {count} prompts"
            )
        for item in batch[: count - len(out.rows)]:
            text = fill_template(dataset.row(item.index), spec.prompt.template)
            prompt: Any = chat_messages(text, spec.prompt) if chat else item.prompt
            out.rows.append({"prompt": prompt, "uid": item.uid})
            out.items[item.uid] = item
    return out


def completion_text(completion: Any) -> str:
    """TRL's completion (text, or an assistant message list for chat prompts) as text."""
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion)
    return str(completion)


def make_reward(
    spec: AdapterSpec, items: dict[str, PromptItem], manager: RewardManager
) -> Callable[..., list[float]]:
    """A TRL reward function that scores with ``spec``'s reward through ``manager`` (registered)."""

    def miles_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], uid: list[str], **_: Any) -> list[float]:  # fmt: skip
        samples = []
        for u, completion, ids in zip(uid, completions, completion_ids, strict=True):
            sample = RewardSample.from_item(items[u], completion_text(completion), response_length=len(ids))
            sample.max_new_tokens = spec.sampling.max_new_tokens
            samples.append(sample)
        report = manager.score({spec.name: samples})[spec.name]
        if report.rewards is None:
            raise RuntimeError(f"adapter {spec.name!r}: its reward failed: {report.error}")
        return list(report.rewards)

    return miles_reward


class Clock:
    """Wall-clock seconds since :meth:`start`, held-out eval time left out."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.paused = 0.0

    def start(self) -> None:
        self.t0, self.paused = time.perf_counter(), 0.0

    def now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - self.t0 - self.paused


class HeldOut:
    """Greedy generation of the held-out items with a HF model and their accuracy, scored by the
    spec's reward (the eval reward manager, registered) as our eval scores it."""

    def __init__(
        self,
        spec: AdapterSpec,
        held: HeldOutSet,
        tokenizer: Any,
        manager: RewardManager,
        eos_ids: list[int],
        batch: int = 64,
    ) -> None:
        self.spec, self.held, self.tokenizer, self.manager = spec, held, tokenizer, manager
        self.ids = [encode_prompt(tokenizer, item.prompt) for item in held.items]
        self.eos_ids, self.batch = list(eos_ids), batch
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    @torch.no_grad()
    def generate(self, model: Any) -> list[list[int]]:
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=False, max_new_tokens=self.spec.sampling.max_new_tokens,
            eos_token_id=self.eos_ids, pad_token_id=self.pad,
        )  # fmt: skip
        device = next(model.parameters()).device
        outputs: list[list[int]] = []
        for start in range(0, len(self.ids), self.batch):
            chunk = self.ids[start : start + self.batch]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for ids in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk], device=device)
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            for row in out[:, width:].tolist():
                end = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), len(row))
                outputs.append(row[:end])
        return outputs

    def __call__(self, model: Any) -> dict[str, Any]:
        was_training = model.training
        model.eval()
        try:
            outputs = self.generate(model)
        finally:
            model.train(was_training)
        samples = []
        for item, ids in zip(self.held.items, outputs, strict=True):
            sample = RewardSample.from_item(
                item, self.tokenizer.decode(ids, skip_special_tokens=True), len(ids)
            )
            sample.max_new_tokens = self.spec.sampling.max_new_tokens
            samples.append(sample)
        report = self.manager.score({self.spec.name: samples})[self.spec.name]
        if report.rewards is None:
            raise RuntimeError(f"adapter {self.spec.name!r}: its eval reward failed: {report.error}")
        correct = report.correct or [None] * len(samples)
        metrics = eval_metrics([[r] for r in report.rewards], [[c] for c in correct], 1)
        return {
            "acc": metrics.get("eval/accuracy", metrics.get("eval/reward_mean")),
            "se": metrics.get("eval/accuracy_se", metrics.get("eval/reward_mean_se")),
            "size": metrics["eval/size"],
        }


def grpo_config(spec: AdapterSpec, algo: Any, out_dir: str, cuda: bool) -> Any:
    """TRL's settings for ``spec``: our group size, prompts per step, sampling, optimizer and loss
    (``algo``: our resolved :class:`~miles_multilora.algo.config.AlgoConfig`)."""
    from trl import GRPOConfig

    opt, samp = spec.optimizer, spec.sampling
    if opt.schedule != "constant" or opt.warmup_steps:
        raise ValueError(
            f"adapter {spec.name!r}: the peer runs a constant learning rate; set optimizer.schedule"
        )
    if samp.stop or samp.stop_token_ids:
        raise ValueError(f"adapter {spec.name!r}: the peer has no stop strings; drop sampling.stop")
    if algo.dynamic_sampling or algo.tis_cap is not None:
        raise ValueError("the peer runs plain GRPO: algo.dynamic_sampling and algo.tis_cap must be off")
    per_step = spec.prompts_per_step * spec.n_samples_per_prompt
    return GRPOConfig(
        output_dir=out_dir,
        max_steps=int(spec.num_steps or 0),
        per_device_train_batch_size=per_step,  # one optimizer step per generation batch, as ours
        gradient_accumulation_steps=1,
        generation_batch_size=per_step,
        num_generations=spec.n_samples_per_prompt,
        num_iterations=1,
        max_completion_length=samp.max_new_tokens,
        temperature=samp.temperature,
        top_p=samp.top_p,
        top_k=max(samp.top_k, 0),  # ours -1 and TRL's 0: no top-k
        learning_rate=opt.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        adam_epsilon=opt.eps,
        max_grad_norm=opt.clip_grad if opt.clip_grad > 0 else 1e9,
        beta=algo.kl_coef,
        epsilon=algo.eps_low,
        epsilon_high=algo.eps_high,
        loss_type="grpo" if algo.aggregation == "seq_mean" else "dapo",
        scale_rewards="group" if algo.std_normalize else "none",
        shuffle_dataset=False,  # our draw order
        seed=spec.seed,
        use_vllm=False,
        bf16=cuda,
        use_cpu=not cuda,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        push_to_hub=False,
    )


def lora_config(spec: AdapterSpec, families: tuple[str, ...]) -> Any:
    """PEFT LoRA with ``spec``'s rank and alpha on the projections of ``families``."""
    from peft import LoraConfig

    chosen = [f for f in FAMILIES if f in families and (spec.lora_targets is None or f in spec.lora_targets)]
    return LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        target_modules=[m for f in chosen for m in PEFT_TARGETS[f]],
    )  # fmt: skip


class EvalCallback:
    """Held-out eval at step 0 (train begin), every ``every`` steps and at the end (``total``),
    off the clock; prints each step's time."""

    def __init__(self, name: str, held_out: HeldOut, clock: Clock, every: int, total: int) -> None:
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_train_begin(
                self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
            ) -> None:
                outer.evaluate(0, model)

            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                step = state.global_step
                print(
                    f"    peer {outer.name} step {step}/{outer.total}: t={outer.clock.now():.1f} s",
                    flush=True,
                )
                if (outer.every > 0 and step % outer.every == 0) or step == outer.total:
                    outer.evaluate(step, model)

        self.name, self.held_out, self.clock, self.every, self.total = name, held_out, clock, every, total
        self.points: list[dict[str, Any]] = []
        self.callback = _Callback()

    def evaluate(self, step: int, model: Any) -> None:
        if any(p["step"] == step for p in self.points):
            return
        t = self.clock.now()
        start = time.perf_counter()
        point = {"step": step, "t": t, **self.held_out(model)}
        self.clock.paused += time.perf_counter() - start
        self.points.append(point)
        se = f" ± {point['se']:.3f}" if point["se"] is not None else ""
        print(
            f"    peer {self.name} eval at step {step}: acc {point['acc']:.3f}{se} (t={t:.1f} s)", flush=True
        )


def build_trainer(
    spec: AdapterSpec, model: Any, tokenizer: Any, algo: Any, families: tuple[str, ...], out_dir: str,
    rewards: RewardManager, callbacks: list[Any] = (),
) -> tuple[Any, PeerPrompts]:  # fmt: skip
    """TRL's trainer for ``spec`` on ``model`` (a fresh base); registers ``spec``'s reward with
    ``rewards``, which scores TRL's completions."""
    from datasets import Dataset
    from trl import GRPOTrainer

    cuda = next(model.parameters()).device.type == "cuda"
    prompts = peer_prompts(spec, tokenizer, int(spec.num_steps or 0) * spec.prompts_per_step)
    rewards.add_adapter(spec, prompts.dataset)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[make_reward(spec, prompts.items, rewards)],
        args=grpo_config(spec, algo, out_dir, cuda),
        train_dataset=Dataset.from_list(prompts.rows),
        processing_class=tokenizer,
        peft_config=lora_config(spec, families),
        callbacks=list(callbacks),
    )
    return trainer, prompts


def check_prompt_parity(trainer: Any, prompts: PeerPrompts, tokenizer: Any) -> None:
    """Raise when TRL would generate from other token ids than ours for any prompt."""
    ids, _, _ = trainer._tokenize_prompts([row["prompt"] for row in prompts.rows])
    for row, got in zip(prompts.rows, ids, strict=True):
        ours = encode_prompt(tokenizer, prompts.items[row["uid"]].prompt)
        if list(got) != ours:
            raise RuntimeError(
                f"TRL tokenizes prompt {row['uid']} as {list(got)[:12]}..., ours as {ours[:12]}..."
            )


def run_peer(
    spec: AdapterSpec, model_dir: str, algo: Any, families: tuple[str, ...], out_dir: str, cuda: bool
) -> dict[str, Any]:
    """Train ``spec`` with TRL from a fresh base model; its held-out curve and seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_multilora.data.datasets import load_adapter_dataset

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu")
    load_s = time.perf_counter() - start
    rewards, eval_rewards = RewardManager(), RewardManager()
    try:
        train_data = load_adapter_dataset(spec.dataset)
        assert spec.eval is not None, "the comparison needs an eval section"
        held = build_held_out(spec, train_data, tokenizer)
        eval_rewards.add_adapter(spec, held.dataset)
        clock = Clock()
        held_out = HeldOut(spec, held, tokenizer, eval_rewards, [int(tokenizer.eos_token_id)])
        callback = EvalCallback(spec.name, held_out, clock, spec.eval.every, int(spec.num_steps or 0))
        clock.start()  # after the model load, as ours
        trainer, prompts = build_trainer(
            spec, model, tokenizer, algo, families, out_dir, rewards, [callback.callback]
        )
        held_out.eos_ids = list(trainer.eos_token_ids)  # the eval stops where TRL's generation stops
        eos = held_out.eos_ids
        check_prompt_parity(trainer, prompts, tokenizer)
        trainer.train()
        train_s = clock.now()
        return {
            "task": spec.dataset.task or spec.name,
            "points": callback.points,
            "train_s": train_s,
            "train_s_with_eval": train_s + clock.paused,
            "load_s": load_s,
            "eos_ids": eos,
        }
    finally:
        rewards.close()
        eval_rewards.close()
