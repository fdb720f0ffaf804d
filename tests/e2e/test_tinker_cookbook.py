"""tinker-cookbook 0.6.1's own training loops, unmodified, against a real ``tinker-serve``.

The supervised trainer (``tinker_cookbook.supervised.train.main``, with its held-out eval, which
scores with ``SamplingClient.compute_logprobs``), the RL trainer (``tinker_cookbook.rl.train.main``
on ``stable_reinforce``, the loss the cookbook's math RL recipe defaults to, and with a KL penalty
against a reference sampler), the math RL recipe (also at its defaults), the ``rl_numerics_check``
recipe with its sampler-trainer KL, the DPO trainer
(``tinker_cookbook.preference.train_dpo.main``, whose loss runs through ``forward_backward_custom``),
the on-policy distillation and SDFT trainers and the multiplayer ``guess_number`` recipe run a few
steps each, with data built in-process or in tmp files through the cookbook's dataset
builders.

The served model is a tiny random Llama checkpoint written in tmp with the demo model's tokenizer
(SmolLM2's, converted by provision.sh), and it is served under its directory's path, so the
cookbook's ``get_tokenizer(model_name)`` loads that same tokenizer offline. The renderer is
``role_colon``, which works with any tokenizer. Nothing here reaches the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tests.e2e.conftest import tinker_server  # noqa: E402

pytest.importorskip("tinker_cookbook")

import chz  # noqa: E402 - after the skips: both come with tinker-cookbook
from tinker_cookbook import checkpoint_utils, renderers  # noqa: E402
from tinker_cookbook.preference import train_dpo  # noqa: E402
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons  # noqa: E402
from tinker_cookbook.preference.preference_datasets import ComparisonDatasetBuilder  # noqa: E402
from tinker_cookbook.preference.types import Comparison, LabeledComparison  # noqa: E402
from tinker_cookbook.recipes.decisions.decision import DecisionRendering, sample_decision  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder  # noqa: E402
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402
from tinker_cookbook.utils import cost_estimation  # noqa: E402

KEY = "tml-cookbook-test-key"
RENDERER = "role_colon"
CONVERSATIONS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Name a primary colour.", "Red is a primary colour."),
    ("What do bees make?", "Bees make honey."),
    ("How many legs has a spider?", "A spider has eight legs."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Which planet is red?", "Mars is the red planet."),
    ("What do cows drink?", "Cows drink water."),
    ("What is two plus two?", "Two plus two is four."),
    ("Where do fish live?", "Fish live in water."),
    ("What colour is the sky?", "The sky is blue."),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (hidden 128, 2 layers) with the demo model's tokenizer and vocabulary."""
    from transformers import AutoTokenizer

    from miles_multilora.models.demo_model import prepare_demo_model
    from tests.helpers import tiny_hf_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_demo_model(os.environ.get("MILES_MULTILORA_CACHE")))
    out = tmp_path_factory.mktemp("cookbook-model")
    tiny_hf_model(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, max_position_embeddings=512, seed=0
    ).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from tinker_server(
        tmp_path_factory.mktemp("cookbook-serve"), KEY, {"source": "hf", "hf_path": str(model_dir)},
        lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 32},
        # the cookbook sends no seeds (models, samples): the same seeds in every run of this file
        tinker={"batch_window_s": 0.02, "reproducible_seed": 0},
    )  # fmt: skip


@pytest.fixture
def cookbook_env(server: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """What a user sets to point the cookbook at tinker-serve: the API key in ``TINKER_API_KEY``
    (the cookbook's ``ServiceClient`` reads it; ``base_url`` goes in each Config). The cookbook's
    trainers also download a pricing file from Tinker's docs site once per process (a failure only
    drops the cost estimate); no network here, so it is marked as already tried. The trainers
    replace the root logger's handlers (console and a file in their log_path): put them back after."""
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True)
    monkeypatch.setattr(cost_estimation, "_pricing_entries", None)
    assert server.state.base_model == str(model_dir)  # served under its directory's path
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield server
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line]


def _checkpoints(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line]


def _finite(row: dict[str, Any], key: str) -> float:
    assert key in row, f"{key} not logged: {sorted(row)}"
    value = float(row[key])
    assert math.isfinite(value), (key, value)
    return value


def _logprobs(server: Any, tokens: list[int], model_path: str | None) -> list[float]:
    """The prompt logprobs of ``tokens`` under saved sampler weights (or the base model)."""
    return _logprobs_of_each(server, [tokens], model_path)[0]


def _logprobs_of_each(server: Any, sequences: list[list[int]], model_path: str | None) -> list[list[float]]:
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        if model_path is None:
            sampler = sc.create_sampling_client(base_model=server.state.base_model).result()
        else:
            sampler = sc.create_sampling_client(model_path=model_path).result()
        futures = [sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)) for tokens in sequences]
        return [[x for x in f.result() if x is not None] for f in futures]  # None: the first token
    finally:
        sc.close("success")


# the cookbook's checkpoint_utils calls the SDK's deprecated create_rest_client (its warning, not ours)
@pytest.mark.filterwarnings("ignore:DEPRECATED. ServiceClient.create_rest_client:FutureWarning")
def test_supervised_trainer_trains_and_evaluates_held_out_data(cookbook_env: Any, tmp_path: Path) -> None:
    server = cookbook_env
    model_name = server.state.base_model
    data = tmp_path / "conversations.jsonl"
    with data.open("w") as f:
        for q, a in CONVERSATIONS:
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                )
            )
            f.write("\n")
    log_path = tmp_path / "sl"
    config = sl_train.Config(
        log_path=str(log_path),
        model_name=model_name,
        recipe_name="test_sl",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(data),
            test_size=2,
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model_name, renderer_name=RENDERER, max_length=64, batch_size=4
            ),
        ),
        learning_rate=5e-3,
        lr_schedule="constant",
        lora_rank=8,
        base_url=server.url,
        eval_every=1,
        save_every=0,
    )
    asyncio.run(sl_train.main(config))

    rows = _metrics(log_path)
    assert [r["step"] for r in rows] == [0, 1], rows  # 8 training conversations, batches of 4
    train_nll = [_finite(r, "train_mean_nll") for r in rows]
    test_nll = [_finite(r, "test/nll") for r in rows]  # held-out eval: compute_logprobs on a sampler
    _finite(rows[-1], "train_mean_bpb")
    # step 1's forward/backward and eval ran on the weights step 0's optim_step made
    assert train_nll[1] < train_nll[0] - 0.05, train_nll
    assert test_nll[1] != pytest.approx(test_nll[0], abs=1e-4), test_nll

    # the final checkpoint (state and sampler weights) was saved; its weights are not the base's
    final = _checkpoints(log_path)[-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://"), final
    tokens = get_tokenizer(model_name).encode("User: What do bees make?\n\nAssistant: Bees make honey.\n\n")
    trained = _logprobs(server, tokens, final["sampler_path"])
    base = _logprobs(server, tokens, None)
    assert sum(trained) > sum(base) + 1.0, (sum(trained), sum(base))

    # a new run from that checkpoint (load_checkpoint_path: create_training_client_from_state, after
    # the cookbook checks the checkpoint's renderer in its run's user_metadata through the REST API)
    # starts from the trained weights: its first held-out eval is the final sampler's, not the base's
    resumed_path = tmp_path / "sl-from-checkpoint"
    asyncio.run(
        sl_train.main(
            chz.replace(
                config, log_path=str(resumed_path), load_checkpoint_path=final["state_path"], max_steps=1
            )
        )
    )
    resumed = _metrics(resumed_path)
    assert [r["step"] for r in resumed] == [0], resumed
    # what the cookbook read there (a failure of that read is only its warning): its own metadata
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    run = rest.get_training_run_by_tinker_path(final["state_path"]).result()
    assert (run.user_metadata or {}).get(checkpoint_utils.RENDERER_NAME_METADATA_KEY) == RENDERER, run
    _, test_set = config.dataset_builder()
    assert test_set is not None
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        sampler = sc.create_sampling_client(model_path=final["sampler_path"]).result()
        expected = asyncio.run(SamplerNLLEvaluator.from_dataset(test_set)(sampler))["test/nll"]
    finally:
        sc.close("success")
    assert _finite(resumed[0], "test/nll") == pytest.approx(expected, abs=1e-4), (resumed[0], expected)
    assert abs(expected - test_nll[0]) > 0.05, (expected, test_nll)


class _EvenLengthEnv(ProblemEnv):
    """Rewards a response of an even number of characters: about half of a random tiny model's
    samples are, so a group's rewards differ and its advantages are not all zero."""

    def get_question(self) -> str:
        return "Write a word."

    def check_answer(self, sample_str: str) -> bool:
        return len(sample_str) % 2 == 0

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "any text of an even length"


class _NoRewardEnv(_EvenLengthEnv):
    """Every response earns 0 (no answer reward, no format term), so every group-centred advantage
    is 0: only a KL penalty can give the policy gradient anything to follow."""

    def __init__(self, renderer: renderers.Renderer):
        super().__init__(renderer, format_coef=0.0)

    def check_answer(self, sample_str: str) -> bool:
        return False


class _EvenLengthDataset(RLDataset):
    def __init__(
        self,
        renderer: renderers.Renderer,
        batch_size: int,
        group_size: int,
        n_batches: int,
        env: type[ProblemEnv] = _EvenLengthEnv,
    ):
        self.renderer = renderer
        self.env = env
        self.batch_size = batch_size
        self.group_size = group_size
        self.n_batches = n_batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [
            ProblemGroupBuilder(env_thunk=partial(self.env, self.renderer), num_envs=self.group_size)
            for _ in range(self.batch_size)
        ]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class _EvenLengthDatasetBuilder(RLDatasetBuilder):
    model_name_for_tokenizer: str
    batch_size: int
    group_size: int
    n_batches: int
    no_reward: bool = False  # _NoRewardEnv instead of _EvenLengthEnv

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name_for_tokenizer))
        env = _NoRewardEnv if self.no_reward else _EvenLengthEnv
        return _EvenLengthDataset(renderer, self.batch_size, self.group_size, self.n_batches, env), None


def _run_rl_trainer(
    server: Any, log_path: Path, recipe: str, no_reward: bool = False, **config: Any
) -> list[dict[str, Any]]:
    """Two steps of the cookbook's RL trainer on :class:`_EvenLengthDataset` (4 groups of 4, 5 new
    tokens, rank 8) with ``config`` on top; the metric rows of the steps."""
    model_name = server.state.base_model
    dataset = _EvenLengthDatasetBuilder(
        model_name_for_tokenizer=model_name, batch_size=4, group_size=4, n_batches=2, no_reward=no_reward
    )
    asyncio.run(rl_train.main(rl_train.Config(
        log_path=str(log_path), model_name=model_name, recipe_name=recipe, renderer_name=RENDERER,
        dataset_builder=dataset, learning_rate=5e-2, max_tokens=5, lora_rank=8, base_url=server.url,
        eval_every=0, save_every=0, num_groups_to_log=0, rollout_json_export=False, **config,
    )))  # fmt: skip
    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]  # the last row: timings only
    assert [r["step"] for r in rows] == [0, 1], rows
    return rows


def test_rl_trainer_with_stable_reinforce_changes_the_model(cookbook_env: Any, tmp_path: Path) -> None:
    server = cookbook_env
    model_name = server.state.base_model
    log_path = tmp_path / "rl"
    # stable_reinforce: the math RL recipe's default (recipes/math_rl/train.py)
    rows = _run_rl_trainer(server, log_path, "test_rl", loss_fn="stable_reinforce")
    for row in rows:
        assert -0.1 <= _finite(row, "env/all/reward/total") <= 0.9, row  # format -0.1, answer +1
        _finite(row, "optim/entropy")
        assert abs(_finite(row, "optim/kl_sample_train_v2")) < 1e-3, row  # sampler and trainer agree
    _assert_final_weights_moved(server, log_path, model_name)


def _assert_final_weights_moved(server: Any, log_path: Path, model_name: str) -> None:
    """The run's final checkpoint exists, and its sampler weights score a text differently from
    the base model."""
    final = _checkpoints(log_path)[-1]
    assert final["name"] == "final", final
    tokens = get_tokenizer(model_name).encode("User: Write a word.\n\nAssistant: tree\n\n")
    trained = _logprobs(server, tokens, final["sampler_path"])
    base = _logprobs(server, tokens, None)
    assert max(abs(a - b) for a, b in zip(trained, base, strict=True)) > 1e-3, (trained, base)


def _trained_sampler_weights(server: Any, text: str, name: str) -> str:
    """Sampler weights of a LoRA fitted to ``text`` for a few steps (the SDK directly), saved
    under ``name``; its session is then closed, and named weights outlive it."""
    tokens = get_tokenizer(server.state.base_model).encode(text)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        tc = sc.create_lora_training_client(base_model=server.state.base_model, rank=8).result()
        for _ in range(4):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(tinker.AdamParams(learning_rate=1e-1)).result()
        return tc.save_weights_for_sampler(name).result().path
    finally:
        sc.close("success")


def test_rl_trainer_applies_a_kl_penalty_against_a_saved_reference(cookbook_env: Any, tmp_path: Path) -> None:
    """``kl_penalty_coef > 0``: the cookbook scores each batch's samples with a reference sampler
    (``kl_reference_config``: here the base model with saved LoRA weights, ``model_path``) and adds
    ``coef * (mean - (log p_sampled - log p_ref))`` to every token's advantage, logging the mean as
    ``kl_policy_base``. The environment rewards nothing, so all group advantages are 0 and without
    the penalty the weights could not move (the loss's gradient is 0); the policy starts at the
    base model, which the reference is not, so the penalty is not 0 from the first step."""
    server = cookbook_env
    model_name = server.state.base_model
    reference = _trained_sampler_weights(server, "User: Write a word.\n\nAssistant: tree\n\n", "kl-reference")
    log_path = tmp_path / "rl-kl"
    rows = _run_rl_trainer(
        server, log_path, "test_rl_kl", no_reward=True, kl_penalty_coef=1.0,
        kl_reference_config=rl_train.KLReferenceConfig(base_model=model_name, load_checkpoint_path=reference),
    )  # fmt: skip
    for row in rows:
        assert _finite(row, "env/all/reward/total") == 0.0, row
        assert abs(_finite(row, "optim/kl_sample_train_v2")) < 1e-3, row
    # E[log p_policy - log p_ref] over the policy's samples. At step 0 the policy is the base model:
    # with the base as the reference this is 0 (to 1e-8 on fp32); so the reference's saved weights
    # were loaded and scored the samples
    kl = [_finite(row, "kl_policy_base") for row in rows]
    assert abs(kl[0]) > 1e-3, kl

    # the final sampler weights are not the base's: with every reward 0, only the penalty's
    # advantages can have moved them (a run without it has all-zero advantages and gradients)
    _assert_final_weights_moved(server, log_path, model_name)


@chz.chz
class _PromptsBuilder(RLDatasetBuilder):
    """The cookbook's own prompt-only distillation dataset over this file's questions (its builder
    loads DeepMath or Tulu3 from the hub)."""

    model_name_for_tokenizer: str
    groups_per_batch: int
    group_size: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        from tinker_cookbook.distillation.datasets import PromptOnlyDataset

        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(RENDERER, tokenizer)
        prompts = [question for question, _ in CONVERSATIONS[:4]]
        return PromptOnlyDataset(prompts, self.groups_per_batch, self.group_size, renderer, tokenizer), None


def _distill(server: Any, log_path: Path, teacher: str | None) -> list[dict[str, Any]]:
    """Two steps of ``tinker_cookbook.distillation.train_on_policy`` from a fresh student; the
    metric rows of the steps."""
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

    model_name = server.state.base_model
    dataset = DistillationDatasetConfig(
        dataset_builder=_PromptsBuilder(
            model_name_for_tokenizer=model_name, groups_per_batch=2, group_size=2
        ),
        teacher_config=TeacherConfig(base_model=model_name, load_checkpoint_path=teacher),
        groups_per_batch=2,
    )
    config = train_on_policy.Config(
        learning_rate=5e-2, dataset_configs=[dataset], model_name=model_name, recipe_name="test_distill",
        renderer_name=RENDERER, max_tokens=5, lora_rank=8, log_path=str(log_path), base_url=server.url,
        eval_every=0, save_every=0,
    )  # fmt: skip
    asyncio.run(train_on_policy.main(config))
    rows = [r for r in _metrics(log_path) if "teacher_kl" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    return rows


def test_on_policy_distillation_scores_the_students_samples_with_the_teacher(
    cookbook_env: Any, tmp_path: Path
) -> None:
    """The on-policy distillation trainer: the student samples, the teacher's sampler scores those
    samples (``compute_logprobs``), and the reverse KL ``log p_student - log p_teacher`` of each
    token is its advantage. A fresh student is the base model: with the base as its teacher the KL
    of the first step is 0 (the sampler's logprobs equal the teacher's scoring of the same tokens),
    with a trained teacher it is not, and the student's weights move."""
    server = cookbook_env
    same = _distill(server, tmp_path / "base-teacher", teacher=None)
    assert abs(_finite(same[0], "teacher_kl")) < 1e-4, same[0]
    teacher = _trained_sampler_weights(server, "User: What do bees make?\n\nAssistant: Honey.\n\n", "teacher")
    log_path = tmp_path / "trained-teacher"
    rows = _distill(server, log_path, teacher=teacher)
    assert abs(_finite(rows[0], "teacher_kl")) > 1e-3, rows[0]
    _assert_final_weights_moved(server, log_path, server.state.base_model)


def test_sdft_trains_the_student_on_the_teachers_topk_targets(cookbook_env: Any, tmp_path: Path) -> None:
    """Self-distillation fine-tuning (``tinker_cookbook.distillation.sdft.main`` with the recipe's own
    ``SDFTDataset`` over local questions and answers; its builders download SciKnowEval or ToolAlpaca):
    the student samples, the teacher (the same model, the golden answer in its prompt) returns its
    top-k prompt logprobs at the student's tokens, and the student trains on ``cross_entropy`` with
    ``[N, K]`` targets and weights."""
    from tinker_cookbook.distillation import sdft
    from tinker_cookbook.recipes.sdft.datasets import SDFTDataset

    server = cookbook_env
    model_name = server.state.base_model
    log_path = tmp_path / "sdft"
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(model_name))
    questions, answers = (list(x) for x in zip(*CONVERSATIONS[:4], strict=True))
    config = sdft.Config(
        model_name=model_name, recipe_name="test_sdft", renderer_name=RENDERER, lora_rank=8,
        base_url=server.url, learning_rate=5e-2, max_tokens=5, topk=5, log_path=str(log_path),
        eval_every=0, save_every=0, max_steps=2,
    )  # fmt: skip
    asyncio.run(sdft.main(config, SDFTDataset(questions, answers, 2, 1, renderer)))
    rows = [r for r in _metrics(log_path) if "sdft/topk" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        assert row["sdft/topk"] == 5 and _finite(row, "sdft/mean_teacher_entropy") > 0, row
    _assert_final_weights_moved(server, log_path, model_name)


def test_guess_number_recipe_plays_multi_turn_episodes(cookbook_env: Any, tmp_path: Path) -> None:
    """The multiplayer recipe ``guess_number`` as its ``build_config`` makes it (only the model,
    renderer, sizes, rank and server named): multi-turn episodes, each turn a new sample on a prompt that
    grows with the game's replies, trained by the RL trainer."""
    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as guess_number

    server = cookbook_env
    log_path = tmp_path / "guess-number"
    cli = guess_number.CLIConfig(
        model_name=server.state.base_model, renderer_name=RENDERER, group_size=2, batch_size=2,
        learning_rate=5e-2, max_tokens=6, eval_every=0, save_every=0, log_path=str(log_path), max_steps=2,
    )  # fmt: skip
    # the recipe leaves the LoRA rank at the trainer's default 32; this server's slots hold rank 8
    config = chz.replace(guess_number.build_config(cli), base_url=server.url, lora_rank=8)
    asyncio.run(rl_train.main(config))
    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        assert _finite(row, "env/all/turns_per_episode") >= 1, row
        assert abs(_finite(row, "optim/kl_sample_train_v2")) < 1e-3, row  # sampler and trainer agree


@pytest.mark.parametrize("max_steps_off_policy", [None, 1], ids=["sync", "async"])
def test_math_rl_recipe_runs_as_is_on_its_default_loss(
    cookbook_env: Any, tmp_path: Path, max_steps_off_policy: int | None
) -> None:
    """The math RL recipe's own entry point (``recipes/math_rl/train.py``'s ``cli_main``) on its
    arithmetic environment, which makes its problems in-process, with the recipe's defaults but for
    the model, the renderer, the server and a small batch: its loss is ``stable_reinforce``. Async:
    the recipe's off-policy mode, where rollouts of the previous step's sampler overlap training."""
    from tinker_cookbook.recipes.math_rl import train as math_rl

    server = cookbook_env
    log_path = tmp_path / "math_rl"
    cli = math_rl.CLIConfig(
        model_name=server.state.base_model,
        renderer_name=RENDERER,
        lora_rank=8,
        env="arithmetic",
        group_size=2,
        groups_per_batch=2,
        max_steps=2,
        eval_every=0,
        save_every=0,
        log_path=str(log_path),
        base_url=server.url,
        behavior_if_log_dir_exists="raise",
        max_steps_off_policy=max_steps_off_policy,
    )
    assert cli.loss_fn == "stable_reinforce"
    asyncio.run(math_rl.cli_main(cli))

    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        _finite(row, "env/all/reward/total")
        _finite(row, "optim/entropy")
    final = _checkpoints(log_path)[-1]
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://"), final


@pytest.mark.slow
def test_math_rl_recipe_runs_a_step_at_its_defaults(cookbook_env: Any, tmp_path: Path) -> None:
    """The math RL recipe at its defaults (arithmetic, 100 groups of 4, 5 new tokens, learning rate
    1e-5, ``stable_reinforce``), but for the model, the renderer, the server and the LoRA rank (its
    32 is above this server's ``lora.max_rank``), for one step: 400 episodes in one batch."""
    from tinker_cookbook.recipes.math_rl import train as math_rl

    server = cookbook_env
    log_path = tmp_path / "math_rl_defaults"
    cli = math_rl.CLIConfig(
        model_name=server.state.base_model, renderer_name=RENDERER, lora_rank=8, base_url=server.url,
        log_path=str(log_path), behavior_if_log_dir_exists="raise", max_steps=1,
    )  # fmt: skip
    assert (cli.env, cli.group_size, cli.groups_per_batch, cli.max_tokens) == ("arithmetic", 4, 100, 5)
    asyncio.run(math_rl.cli_main(cli))

    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0], rows
    assert rows[0]["env/all/total_episodes"] == 400, rows[0]
    assert rows[0]["env/all/ac_tokens_per_turn"] <= 5, rows[0]
    _finite(rows[0], "env/all/reward/total")
    assert abs(_finite(rows[0], "optim/kl_sample_train_v2")) < 1e-6, rows[0]  # sampler and trainer agree
    assert _checkpoints(log_path)[-1]["name"] == "final"


@chz.chz
class _PairsFromFile(ComparisonDatasetBuilder):
    """Preference pairs from a local JSONL file of ``{"prompt", "chosen", "rejected"}`` rows."""

    file_path: str

    def get_train_and_test_datasets(self) -> tuple[Any, None]:
        import datasets

        rows = [json.loads(line) for line in Path(self.file_path).read_text().splitlines() if line]
        return datasets.Dataset.from_list(rows), None

    def example_to_labeled_comparison(self, example: dict) -> LabeledComparison | None:
        comparison = Comparison(
            prompt_conversation=[{"role": "user", "content": example["prompt"]}],
            completion_A=[{"role": "assistant", "content": example["chosen"]}],
            completion_B=[{"role": "assistant", "content": example["rejected"]}],
        )
        return LabeledComparison(comparison=comparison, label="A")


def _preference_margins(
    server: Any, pairs: list[tuple[str, str, str]], model_path: str | None
) -> list[float]:
    """Each pair's log p(chosen) - log p(rejected), summed over the response tokens that the DPO
    datums weigh, under saved sampler weights (or the base model)."""
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(server.state.base_model))
    examples = [
        renderer.build_supervised_example([
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": response},
        ])
        for prompt, chosen, rejected in pairs
        for response in (chosen, rejected)
    ]  # fmt: skip
    logprobs = _logprobs_of_each(server, [m.to_ints() for m, _ in examples], model_path)
    sums = [
        sum(lp * w for lp, w in zip(lps, weights.tolist()[1:], strict=True))  # weights[0]: no logprob
        for lps, (_, weights) in zip(logprobs, examples, strict=True)
    ]
    return [chosen - rejected for chosen, rejected in zip(sums[::2], sums[1::2], strict=True)]


def test_dpo_trainer_raises_the_preference_margin(cookbook_env: Any, tmp_path: Path) -> None:
    """``tinker_cookbook.preference.train_dpo.main`` on local pairs: its reference is the initial
    weights' sampler (``save_weights_and_get_sampling_client``, scored by ``compute_logprobs``) and
    its loss runs through ``forward_backward_custom`` (a forward, the DPO loss on the client, then
    a weighted cross-entropy backward)."""
    server = cookbook_env
    model_name = server.state.base_model
    # chosen: the answer; rejected: the same unhelpful reply to every question
    pairs = [(q, a, "I do not know.") for q, a in CONVERSATIONS[:8]]
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in pairs)
    )
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log_path),
        model_name=model_name,
        recipe_name="test_dpo",
        renderer_name=RENDERER,
        dataset_builder=DPODatasetBuilderFromComparisons(
            comparison_builder=_PairsFromFile(file_path=str(data)),
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model_name, renderer_name=RENDERER, max_length=64, batch_size=4
            ),
        ),
        learning_rate=5e-3,  # 1e-2 overshot at epoch 2 in some runs (the LoRA's init is random)
        lr_schedule="constant",
        num_epochs=2,
        dpo_beta=0.1,
        lora_rank=8,
        base_url=server.url,
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
    )
    train_dpo.main(config)

    rows = [r for r in _metrics(log_path) if "dpo_loss" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3], rows  # 8 pairs, batches of 4, two epochs
    for row in rows:
        assert row["num_pairs"] == 4, row
        for key in ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward"):
            _finite(row, key)
    # step 0: the policy is the reference (its sampler scores as the trainer's forward does), so
    # every log ratio is 0 and the loss is log 2; then the loss falls and the margin grows
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3), rows[0]
    assert rows[0]["margin"] == pytest.approx(0.0, abs=1e-3), rows[0]
    for row in rows[1:]:
        assert row["dpo_loss"] < math.log(2) - 0.05 and row["margin"] > 0.1, row
    assert rows[-1]["dpo_loss"] < rows[1]["dpo_loss"], rows

    # the final sampler weights prefer the chosen responses more than the base model does
    final = _checkpoints(log_path)[-1]
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://"), final
    trained = _preference_margins(server, pairs, final["sampler_path"])
    base = _preference_margins(server, pairs, None)
    gains = [t - b for t, b in zip(trained, base, strict=True)]
    assert sum(gains) / len(gains) > 2.0 and sum(g > 0 for g in gains) >= 6, (trained, base)


def test_the_decisions_recipe_scores_each_label_in_one_sample_request(cookbook_env: Any) -> None:
    """The ``decisions`` recipe's ``sample_decision``: one sample request whose sparse
    ``target_prompt_logprobs`` scores every label's token at the answer position. Its probabilities
    are the softmax of those tokens' prompt logprobs, each scored alone."""
    server = cookbook_env
    rendering = DecisionRendering([1, 5, 17, 33, 9, 60, 2, 44, 0], 8, {"A": 11, "B": 12, "C": 13})
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        sampler = sc.create_sampling_client(base_model=server.state.base_model).result()
        chosen = asyncio.run(sample_decision(sampler, rendering))
    finally:
        sc.close("success")
    sequences = [rendering.with_label(label) for label in rendering.labels]
    each = [lp[rendering.choice_pos - 1] for lp in _logprobs_of_each(server, sequences, None)]
    total = sum(math.exp(lp) for lp in each)
    assert list(chosen) == ["A", "B", "C"]
    assert list(chosen.values()) == pytest.approx([math.exp(lp) / total for lp in each], abs=1e-5)


def test_rl_numerics_check_recipe_logs_a_small_sampler_trainer_kl(
    cookbook_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``rl_numerics_check`` recipe as its ``build_config`` makes it (loss ``importance_sampling``,
    its counting environment with the ``read_page`` tool), at a tiny size: one-page documents of 300
    characters, 8 new tokens. Its corpus is WikiText-103 from the hub; here the same loader returns
    this project's design notes (English text), the one thing replaced. The renderer is
    ``qwen3_instruct``: the recipe needs tool calling, which ``role_colon`` lacks, and the demo
    tokenizer is ChatML. The recipe's check is ``optim/kl_sample_train_v1`` and ``_v2``: the sampler's
    logprobs of the sampled tokens against the trainer's forward on them."""
    from tinker_cookbook.recipes.rl_numerics_check import env as numerics_env
    from tinker_cookbook.recipes.rl_numerics_check import train as numerics

    server = cookbook_env
    corpus = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    monkeypatch.setattr(numerics_env, "load_wikitext_corpus", lambda max_chars=0: corpus)
    log_path = tmp_path / "numerics"
    cli = numerics.CLIConfig(
        model_name=server.state.base_model, renderer_name="qwen3_instruct", lora_rank=8, group_size=2,
        groups_per_batch=2, max_tokens=8, max_trajectory_tokens=2048, max_steps=2, save_every=0,
        task=numerics_env.CountingTaskConfig(num_pages_min=1, num_pages_max=1, page_chars=300),
        log_path=str(log_path), base_url=server.url,
    )  # fmt: skip
    asyncio.run(rl_train.main(numerics.build_config(cli)))

    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        _finite(row, "env/all/reward/total")
        assert abs(_finite(row, "optim/kl_sample_train_v1")) < 1e-4, row
        assert 0 <= _finite(row, "optim/kl_sample_train_v2") < 1e-6, row
