"""The compatibility table of ``docs/tinker.md`` against the SDK (pinned 0.38.0) and a real
``tinker-serve`` (tiny model, two tenants): the table lists every public method of the SDK's four
clients (a method the SDK adds fails here until it has a row), every method it marks "not served"
raises exactly the error it states (the sync method and its ``_async`` twin), and two methods it
marks served that the rest of the suite does not call: ``forward_backward_custom`` (the SDK's
client-side custom loss) and ``SamplingClient.from_sampler_handle``.
"""

from __future__ import annotations

import asyncio
import builtins
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.e2e.test_tinker_tenants import KEY_A, KEY_B, TEXT, Served, serving, sft  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "tinker.md"
CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
STATUSES = {"served", "client-side", "not served"}
# "`BadRequestError` 400: `message`" or "`RuntimeError`: `message`"
ERROR = re.compile(r"^`(?P<exc>\w+)`(?: (?P<status>\d{3}))?: `(?P<message>[^`]+)`$")


def compatibility_table() -> dict[str, dict[str, str]]:
    """The rows of the doc's Compatibility section: ``Class.method`` -> its cells."""
    text = DOC.read_text()
    section = text.split("\n## Compatibility\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, dict[str, str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, line
        method = cells[0].strip("`")
        assert method not in rows, f"{method} has two rows"
        rows[method] = {"route": cells[1], "status": cells[2], "notes": cells[3]}
    return rows


TABLE = compatibility_table()
NOT_SERVED = sorted(m for m, row in TABLE.items() if row["status"] == "not served")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serving(tmp_path_factory.mktemp("tinker_compat"))


@pytest.fixture(scope="module")
def clients(served: Served) -> Iterator[dict[str, Any]]:
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    sc_b = tinker.ServiceClient(base_url=served.url, api_key=KEY_B)
    yield {
        "sc": sc, "sc_b": sc_b, "session": sc.holder.get_session_id(),
        "rest": tinker.RestClient(base_url=served.url, api_key=KEY_A),
    }  # fmt: skip
    for client in (sc, sc_b):
        client.close("success").result()


# ---------------------------------------------------------------------------- the table is whole
def test_the_table_lists_every_public_method_of_the_four_clients() -> None:
    listed = {cls: set() for cls in CLASSES}
    for method, row in TABLE.items():
        cls, _, name = method.partition(".")
        assert cls in listed, f"{method}: not a method of {CLASSES}"
        assert row["status"] in STATUSES, f"{method}: status {row['status']!r} not in {STATUSES}"
        assert row["route"] and row["notes"], method
        listed[cls].add(name)
    for cls in CLASSES:
        public = {n.removesuffix("_async") for n in dir(getattr(tinker, cls)) if not n.startswith("_")}
        assert public - listed[cls] == set(), f"{cls} methods missing from docs/tinker.md's table"
        assert listed[cls] - public == set(), f"rows of docs/tinker.md's table that {cls} lacks"


# ---------------------------------------------------------------------------- not served: the exact error
def _calls(c: dict[str, Any], name: str) -> Callable[[], Any]:
    """The call of method ``name`` (sync, or ``name_async`` as a coroutine function)."""
    rest, session = c["rest"], c["session"]
    args: dict[str, tuple[Any, ...]] = {
        "RestClient.assign_session_project": (session, "default"),
        "RestClient.export_session_trace": (session,),
        "RestClient.get_audit_log": (),
        "RestClient.get_billing_usage": ("2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"),
        "RestClient.get_current_checkpoint_storage_usage": (),
        "RestClient.search_sessions": (types.SessionSearchRequest(),),
        "RestClient.whoami": (),
    }
    method = name.removesuffix("_async")
    assert method in args, f"{method} is not served by the table: add its call here"
    fn = getattr(rest, name.rpartition(".")[2])
    if name.endswith("_async"):
        return lambda: asyncio.run(fn(*args[method]))
    return lambda: fn(*args[method]).result()


def _variants() -> list[str]:
    out = []
    for method in NOT_SERVED:
        cls, _, name = method.partition(".")
        out.append(method)
        if hasattr(getattr(tinker, cls), f"{name}_async"):
            out.append(f"{method}_async")
    return out


@pytest.mark.parametrize("call", _variants())
def test_a_method_not_served_raises_the_error_the_table_states(clients: dict[str, Any], call: str) -> None:
    row = TABLE[call.removesuffix("_async")]
    stated = ERROR.match(row["notes"])
    assert stated, f"{call}: the notes of a row not served must be `Exception` [status]: `message`"
    expected = getattr(tinker, stated["exc"], None) or getattr(builtins, stated["exc"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated and experimental methods warn
        with pytest.raises(expected) as raised:
            _calls(clients, call)()
    error = raised.value
    assert type(error) is expected
    if stated["status"] is None:
        assert str(error) == stated["message"]
    else:
        assert error.status_code == int(stated["status"])
        assert error.body["detail"] == stated["message"]
        assert error.body["category"] == "user"


# ---------------------------------------------------------------------------- served, by the SDK's client side
def _logprobs(tc: Any) -> torch.Tensor:
    return torch.tensor(
        tc.forward([sft(TEXT)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )


def test_forward_backward_custom_trains_as_the_builtin_loss_it_amounts_to(clients: dict[str, Any]) -> None:
    """An unlikelihood loss ``sum(w * logprobs)`` in the client (its gradient: negative weights on
    the server) steps the model exactly as ``cross_entropy`` with weights ``-w`` does."""
    sc = clients["sc"]
    w = [0.5 + 0.25 * (i % 3) for i in range(len(TEXT) - 1)]
    custom_tc, builtin_tc = (
        sc.create_lora_training_client(base_model="tiny", rank=4, seed=11).result() for _ in range(2)
    )
    assert torch.equal(_logprobs(custom_tc), _logprobs(builtin_tc))  # the same start

    def unlikelihood(logprobs: Any, weights: Any) -> tuple[Any, dict[str, Any]]:
        loss = (logprobs * weights).sum()
        return loss, {"custom/unlikelihood:sum": loss}

    handle = sc.create_custom_loss(unlikelihood, input_ranks={"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is None  # kept in the client: the server asks for no upload
    before = _logprobs(custom_tc)
    out = custom_tc.forward_backward_custom([sft(TEXT, w)], handle).result()
    expected_loss = float((before * torch.tensor(w)).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    builtin = builtin_tc.forward_backward([sft(TEXT, [-x for x in w])], "cross_entropy").result()
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    for tc in (custom_tc, builtin_tc):
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    after = _logprobs(custom_tc)
    torch.testing.assert_close(after, _logprobs(builtin_tc))
    assert (after - before).abs().max() > 1e-3  # it moved (down: the loss pushes the text away)
    assert (after * torch.tensor(w)).sum() < (before * torch.tensor(w)).sum()


def test_a_sampler_handle_samples_under_its_tenants_key_only(served: Served, clients: dict[str, Any]) -> None:
    sampler = clients["sc"].create_sampling_client(base_model="tiny").result()
    handle = sampler.get_sampler_handle()
    prompt, params = types.ModelInput.from_ints(TEXT[:5]), types.SamplingParams(max_tokens=4, seed=3)
    want = sampler.sample(prompt, 1, params).result().sequences[0].tokens
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY_A)
    assert again.get_base_model() == "tiny"
    assert again.sample(prompt, 1, params).result().sequences[0].tokens == want
    stranger = tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError, match="unknown sampl"):
        stranger.sample(prompt, 1, params).result()
