"""An inflight sampling client (``save_weights_and_get_sampling_client(kind="inflight")``) of the
official tinker SDK (pinned 0.38.0) against a real ``tinker-serve`` on the tiny model: it samples
its training client's newest weights, while a snapshot keeps the weights it saved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tests.e2e.conftest import sft_datum, tinker_server  # noqa: E402

KEY = "tml-inflight-key"
TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3, 27, 64]
PROMPT = TEXT[:4]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from tinker_server(
        tmp_path_factory.mktemp("tinker-inflight"), KEY, {"source": "tiny"},
        lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 32},
        tinker={"base_model": "tiny", "batch_window_s": 0.02},
    )  # fmt: skip


def test_an_inflight_sampling_client_samples_its_models_newest_weights(server: Any) -> None:
    """``save_weights_and_get_sampling_client(kind="inflight")`` follows its training client: after
    another ``optim_step`` it samples (and scores) exactly what a snapshot of the new weights does,
    while a snapshot saved with it keeps the old weights."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()

    def step() -> None:
        tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()

    def drawn(sampler: Any) -> list[tuple[list[int], list[float]]]:
        params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
        got = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, params).result()
        return [(list(s.tokens), list(s.logprobs)) for s in got.sequences]

    step()
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    first = drawn(snapshot)
    assert drawn(inflight) == first
    step()
    newest = tc.save_weights_and_get_sampling_client().result()
    assert drawn(inflight) == drawn(newest) != first  # the live slot's, not the saved copy's
    assert drawn(snapshot) == first
    prompt = tinker.ModelInput.from_ints(TEXT)
    assert inflight.compute_logprobs(prompt).result() == newest.compute_logprobs(prompt).result()
    sc.close("success").result()
