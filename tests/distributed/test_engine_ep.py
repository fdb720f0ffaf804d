"""The embedded engine at EP=2 (fp32 CPU, gloo, 2 ranks) samples what one rank samples at EP=1.

Each EP rank decodes its own requests while the MoE layers exchange tokens at every prefill and
decode forward, so the ranks must run their forwards in lockstep. On a tiny MoE GPT (4 experts, 2
per rank; two adapters and the base model mixed; greedy and seeded top-p sampling) the sampled
tokens and logprobs of every request equal those of one EP=1 engine generating all of them, with
the rows split between the ranks, with every row on one rank (the other has none), with the
ranks' rows finishing at different steps, and through the stream (continuous rollout: runs that
stop at different conditions on each rank, work submitted between runs, KV pages taken on demand
and rows preempted on one rank only); and at TP=2 x EP=2. Both token dispatchers carry the
prefill's exchange. The adapters are made at EP=1 and loaded as PEFT dirs. A rank that left the
exchange early would hang its peer: the runs are bounded in time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import run_distributed

DISPATCHERS = ("alltoall", "allgather")
VOCAB = 64  # the tiny Qwen3-MoE checkpoint's
PROMPT_LENGTHS = [12, 2, 28, 7, 20]
NEW_TOKENS = [2, 3, 2, 3, 12, 10, 12, 9]  # uids 0-3 end early, 4-7 late
# uids each rank generates, per case
SPLITS = {
    "split": ([0, 2, 5, 7], [1, 3, 4, 6]),
    "one_rank_empty": (list(range(8)), []),
    "finish_apart": ([0, 1, 2, 3], [4, 5, 6, 7]),
}
STREAM = ([0, 1, 2, 3, 4, 5], [7], [6])  # rank 0's first submission, rank 1's, rank 0's second
ADAPTERS = {"math": (0, 3), "code": (2, 1)}  # name -> (slot, version)
SLOT_RANKS = ((0, 4), (2, 2))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE checkpoint (4 experts, top 2; megatron-bridge reads the same weights at every
    layout, a rank its own experts) and two adapters made at EP=1 (PEFT dirs ``adapter{slot}``)."""
    from miles_multilora.lora import apply_multi_lora, export_slot, init_slot
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model
    from tests.moe_helpers import make_tiny_moe_checkpoint, randomize_b

    root = tmp_path_factory.mktemp("engine_ep")
    make_tiny_moe_checkpoint(root / "hf", "qwen3_moe", seed=0)
    compat.init_distributed(tp=1, pp=1, seed=0)
    model = load_hf_model(root / "hf").model
    apply_multi_lora(model, "all-linear", num_slots=3, max_rank=4)
    for slot, lora_rank in SLOT_RANKS:
        init_slot(model, slot, rank=lora_rank, alpha=8.0, seed=slot)
        randomize_b(model, slot, seed=10 + slot, scale=0.3)
        export_slot(model, slot, root / f"adapter{slot}", write=True)
    return root


def _model(root: str, dispatcher: str):  # noqa: ANN202
    from miles_multilora.lora import apply_multi_lora, load_slot
    from miles_multilora.models.provider import load_hf_model

    model = load_hf_model(Path(root) / "hf", moe_token_dispatcher=dispatcher).model
    apply_multi_lora(model, "all-linear", num_slots=3, max_rank=4)
    with torch.no_grad():
        model.output_layer.weight.mul_(20.0)  # peaked next-token distributions: no near-ties
    for slot, _ in SLOT_RANKS:
        load_slot(model, slot, Path(root) / f"adapter{slot}")
    return model


def _requests():  # noqa: ANN202 - uid -> request
    from miles_multilora.config.adapter import SamplingSpec
    from miles_multilora.rollout import GenerationRequest

    gen = torch.Generator().manual_seed(5)
    out = []
    for uid, new in enumerate(NEW_TOKENS):
        greedy = uid % 2 == 0
        sampling = SamplingSpec(
            temperature=0.0 if greedy else 0.7, top_p=1.0 if greedy else 0.9, max_new_tokens=new
        )
        length = PROMPT_LENGTHS[uid % len(PROMPT_LENGTHS)]
        ids = torch.randint(2, VOCAB, (length,), generator=gen).tolist()
        name = ["math", "code", None][uid % 3]
        if name is None:
            out.append(GenerationRequest.for_base(ids, sampling, seed=100 + uid))
        else:
            slot, version = ADAPTERS[name]
            out.append(GenerationRequest(name, slot, version, ids, sampling, seed=100 + uid))
    return out


def _engine(model, **kw):  # noqa: ANN001, ANN202
    from miles_multilora.rollout import AdapterVersion, EmbeddedEngine

    engine = EmbeddedEngine(model, vocab_size=VOCAB, max_seq_len=64, eos_token_ids=[], **kw)
    engine.update_adapters(
        {name: AdapterVersion(slot, version) for name, (slot, version) in ADAPTERS.items()}
    )
    return engine


def _sampled(results) -> list[tuple[list[int], list[float]]]:  # noqa: ANN001
    return [(r.output_ids, r.logprobs) for r in results]


def _stream(model, rank: int) -> tuple[dict[int, tuple], float]:  # noqa: ANN001
    """The stream on small KV pages: rank 0's first run stops when one of its requests ends (rank 1
    runs to the end), then rank 0 submits more and both run to the end. Returns results by uid and
    rank's preemptions."""
    engine = _engine(model, kv_cache_tokens=64, page_size=4)
    reqs = _requests()
    first = STREAM[0] if rank == 0 else STREAM[1]
    ids = engine.submit([reqs[u] for u in first])
    one_ends = (lambda state: any(i in state.finished for i in ids)) if rank == 0 else None
    engine.run(one_ends)
    later = STREAM[2] if rank == 0 else []
    ids2 = engine.submit([reqs[u] for u in later])
    engine.run()
    uids = first + later
    results = engine.take(ids + ids2)
    return dict(zip(uids, _sampled(results), strict=True)), engine.stats["preemptions"]


def _worker(rank: int, world: int, root: str, out: str) -> None:
    from miles_multilora.models import compat

    torch.set_num_threads(1)
    compat.init_distributed(tp=1, pp=1, seed=0, rank=rank, world_size=world, ep=world)
    reqs = _requests()
    found: dict = {}
    for dispatcher in DISPATCHERS:
        model = _model(root, dispatcher)
        for case, shares in SPLITS.items():
            mine = shares[rank]
            results = _engine(model).generate([reqs[u] for u in mine])
            found[(dispatcher, case)] = dict(zip(mine, _sampled(results), strict=True))
        found[(dispatcher, "stream")], found[(dispatcher, "preemptions")] = _stream(model, rank)
    torch.save(found, Path(out) / f"rank{rank}.pt")
    compat.destroy_distributed()


@pytest.fixture(scope="module")
def reference(root) -> dict[str, dict[int, tuple]]:  # noqa: ANN001
    """One EP=1 engine generating every request, per dispatcher."""
    from miles_multilora.models import compat

    compat.init_distributed(tp=1, pp=1, seed=0)
    reqs = _requests()
    return {
        dispatcher: dict(enumerate(_sampled(_engine(_model(str(root), dispatcher)).generate(reqs))))
        for dispatcher in DISPATCHERS
    }


def _compare(got: dict[int, tuple], expected: dict[int, tuple], where: str) -> None:
    assert sorted(got) == list(range(len(NEW_TOKENS))), where
    for uid, (tokens, logprobs) in got.items():
        assert tokens == expected[uid][0], f"{where}, request {uid}"
        diff = (torch.tensor(logprobs) - torch.tensor(expected[uid][1])).abs().max()
        assert diff <= 1e-5, f"{where}, request {uid}: logprobs differ by {diff}"


def test_ep2_engine_samples_as_ep1(tmp_path: Path, root, reference) -> None:  # noqa: ANN001
    run_distributed(_worker, 2, (str(root), str(tmp_path)), timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0][("alltoall", "preemptions")] > 0  # rank 0 took pages on demand and gave some back
    for dispatcher in DISPATCHERS:
        expected = reference[dispatcher]
        assert {len(expected[u][0]) for u in range(4)} <= {2, 3}  # no EOS: every row ran its budget
        for case in (*SPLITS, "stream"):
            got = {**ranks[0][(dispatcher, case)], **ranks[1][(dispatcher, case)]}
            _compare(got, expected, f"{dispatcher}, {case}")


def _tp_worker(rank: int, world: int, root: str, out: str) -> None:
    from miles_multilora.models import compat

    torch.set_num_threads(1)
    compat.init_distributed(tp=2, pp=1, seed=0, rank=rank, world_size=world, ep=2)
    reqs = _requests()
    found = {d: dict(enumerate(_sampled(_engine(_model(root, d)).generate(reqs)))) for d in DISPATCHERS}
    torch.save(found, Path(out) / f"rank{rank}.pt")
    compat.destroy_distributed()


def test_tp2_ep2_engine_samples_as_one_rank(tmp_path: Path, root, reference) -> None:  # noqa: ANN001
    """TP=2 x EP=2 on two ranks (one DP rank: both hold the same rows, each TP rank routes its share
    of the prefill tokens, and a decode step's gathered rows repeat on each rank's experts)."""
    run_distributed(_tp_worker, 2, (str(root), str(tmp_path)), timeout=240)
    for r in range(2):
        found = torch.load(tmp_path / f"rank{r}.pt")
        for dispatcher in DISPATCHERS:
            _compare(found[dispatcher], reference[dispatcher], f"rank {r}, {dispatcher}")
