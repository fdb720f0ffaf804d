"""``tinker-serve`` as a hostile tenant meets it, with the official tinker SDK (pinned 0.38.0) as the
client of the honest tenants and raw HTTP for what the SDK would never send.

Two keys (two tenants) and two clients sharing one key: every cross-tenant operation is refused
exactly like one on an unknown id and changes nothing; ids cannot be guessed. Bodies over the limit
are refused while they stream; a huge forward_backward runs in batches beside a small one; malformed
input is a 400 naming the field; dedup needs a seq_id; results are released. Then the server
restarts (same trainer rank, port and state dir): a future polled across it gets the restart
error, saved states survive, silent sessions expire and free their slots.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

KEY_A, KEY_B = "tml-tenant-a", "tml-tenant-b"
TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3, 27, 64]
API = "/api/v1"
SETTINGS = {
    "base_model": "tiny", "batch_window_s": 0.01, "max_body_mb": 1, "batch_tokens": 512,
    "max_forward_backward_tokens": 16384, "max_sample_tokens": 2048, "sample_batch_tokens": 512,
    "result_ttl_s": 60, "retrieved_result_ttl_s": 1,
}  # fmt: skip


class Served:
    """The server under test; ``restart`` stops it and serves again on the same trainer rank, port
    and state dir (what survives is what survives a restart of ``tinker-serve``)."""

    def __init__(self, root: Path) -> None:
        self.root, self.rank, self.port = root, None, 0
        self.keys = root / "keys"
        self.keys.write_text(f"# two tenants\n{KEY_A}\n\n{KEY_B}\n")
        self.keys.chmod(0o600)
        self.server: Any = None

    def start(self, **settings: Any) -> None:
        from miles_multilora.config.run import config_from_container
        from miles_multilora.tinker.serve import start

        tinker_cfg = {"port": self.port, "api_key_file": str(self.keys), **SETTINGS, **settings}
        cfg = config_from_container({
            "model": {"source": "tiny"},
            "lora": {"num_slots": 4, "max_rank": 8},
            "trainer": {"output_dir": str(self.root / "out"), "micro_batch_size": 32},
            "tinker": tinker_cfg,
            "logging": {"wandb_mode": "disabled"},
        })  # fmt: skip
        self.server = start(cfg, rank=self.rank)
        self.rank = self.server.state.backend.rank
        self.port = int(self.server.url.rsplit(":", 1)[1])

    def restart(self, **settings: Any) -> None:
        self.server.stop()
        self.start(**settings)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> Any:
        return self.server.state


def serving(root: Path, **settings: Any) -> Iterator[Served]:
    """A module's server (``yield from`` it in a module-scoped fixture): started with ``settings``,
    stopped after the module's tests, and the trainer's process group freed for the next module."""
    from miles_multilora.models import compat

    s = Served(root)
    s.start(**settings)
    try:
        yield s
    finally:
        s.server.stop()
        compat.destroy_distributed()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serving(tmp_path_factory.mktemp("tinker_tenants"))


# ---------------------------------------------------------------------------- helpers
def client(served: Served, key: str) -> Any:
    return tinker.ServiceClient(base_url=served.url, api_key=key)


def tensor(values: list[float], dtype: Any) -> Any:
    return tinker.TensorData.from_numpy(np.asarray(values, dtype=dtype))


def sft(tokens: list[int], weights: list[float] | None = None, targets_dtype: Any = np.int64) -> Any:
    n = len(tokens) - 1
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tensor(tokens[1:], targets_dtype),
            "weights": tensor(weights if weights is not None else [1.0] * n, np.float32),
        },
    )


def fb_body(model_id: str, data: list[Any], seq_id: int = 1, forward_only: bool = False) -> bytes:
    """A forward_backward body as the SDK encodes it."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def post(
    served: Served, key: str, route: str, body: Any = None, raw: bytes | None = None
) -> requests.Response:
    headers = {"X-API-Key": key}
    if raw is not None:
        headers["Content-Type"] = "application/x-protobuf"
        return requests.post(f"{served.url}{API}/{route}", data=raw, headers=headers, timeout=60)
    return requests.post(f"{served.url}{API}/{route}", json=body or {}, headers=headers, timeout=60)


def slot_state(served: Served, model_id: str) -> list[torch.Tensor]:
    """The model's slot tensors and its Adam moments and step, copied."""
    backend = served.state.backend
    slot = backend.model(model_id).slot
    optimizer = backend.rank.optimizer
    moments = optimizer.slot_state_dict(slot)
    tensors = [p[slot].detach().clone() for p in optimizer.params]
    tensors += [t.clone() for part in ("exp_avg", "exp_avg_sq") for _, t in sorted(moments[part].items())]
    return [*tensors, torch.tensor(float(moments["step"]))]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def fake(some_id: str) -> str:
    """An id of the same shape that nobody owns (its random tail changed)."""
    head, tail = some_id[:-1], some_id[-1]
    return head + ("0" if tail != "0" else "1")


def answer(response: requests.Response, *ids: str) -> tuple[int, str]:
    """Status and body with the ids blanked, to compare a refusal with the one for an unknown id."""
    text = response.text
    for some_id in ids:
        text = text.replace(json.dumps(some_id)[1:-1], "<id>")
    return response.status_code, text


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- tenants
@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_another_tenant_is_refused_like_unknown_and_changes_nothing(served: Served) -> None:
    victim_sc, shared_sc, attacker_sc = client(served, KEY_A), client(served, KEY_A), client(served, KEY_B)
    victim = victim_sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    vm = victim.get_info().model_id
    session = vm.split(":")[0]
    victim.forward_backward([sft(TEXT)], "cross_entropy").result()
    victim.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    ckpt = victim.save_state("mine").result().path
    snapshot = victim.save_weights_for_sampler("snap").result().path
    victim.save_weights_and_get_sampling_client().result()
    sampler = next(s for s in served.state.registry.samplers.values() if s.model_id == vm)
    # a result of the victim's that is still held (sent outside the SDK, never retrieved)
    held = post(served, KEY_A, "forward_backward", raw=fb_body(vm, [sft(TEXT)], forward_only=True))
    held_rid = held.json()["request_id"]
    ckpt_file = next((served.root / "out" / "tinker").rglob("mine/slot_rank0.pt"))
    ckpt_bytes = ckpt_file.read_bytes()
    before = slot_state(served, vm)

    attacker = attacker_sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    am = attacker.get_info().model_id
    own_session = am.split(":")[0]
    adam = {"learning_rate": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}
    attacks = {  # name -> (route, body for an id; ids to try: the victim's, then a made-up one)
        "retrieve_future": ("retrieve_future", lambda i: {"request_id": i}, held_rid),
        "optim_step": ("optim_step", lambda i: {"model_id": i, "adam_params": adam, "seq_id": 1}, vm),
        "save_weights": ("save_weights", lambda i: {"model_id": i, "path": "mine", "overwrite": True}, vm),
        "load_weights": ("load_weights", lambda i: {"model_id": i, "path": ckpt, "optimizer": True}, vm),
        "unload_model": ("unload_model", lambda i: {"model_id": i}, vm),
        "get_info": ("get_info", lambda i: {"model_id": i}, vm),
        "save_for_sampler": ("save_weights_for_sampler", lambda i: {"model_id": i, "sampling_session_seq_id": 9}, vm),
        "asample": ("asample", lambda i: {"sampling_session_id": i, "num_samples": 1, "seq_id": 1,
                                          "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:3]}]},
                                          "sampling_params": {"max_tokens": 2}}, sampler.sampler_id),
        "create_model": ("create_model", lambda i: {"session_id": i, "model_seq_id": 5, "base_model": "tiny",
                                                    "lora_config": {"rank": 4}}, session),
        "sampling_session": ("create_sampling_session", lambda i: {"session_id": i, "sampling_session_seq_id": 3},
                             session),
        "heartbeat": ("session_heartbeat", lambda i: {"session_id": i}, session),
    }  # fmt: skip
    for name, (route, body, victim_id) in attacks.items():
        got = post(served, KEY_B, route, body(victim_id))
        unknown = post(served, KEY_B, route, body(fake(victim_id)))
        assert got.status_code in (404, 410), (name, got.status_code, got.text)
        assert answer(got, victim_id) == answer(unknown, fake(victim_id)), name
    got = post(served, KEY_B, "forward_backward", raw=fb_body(vm, [sft(TEXT, [1e6] * 13)]))  # weights 1e6
    unknown = post(served, KEY_B, "forward_backward", raw=fb_body(fake(vm), [sft(TEXT, [1e6] * 13)]))
    assert got.status_code == 404 and answer(got, vm) == answer(unknown, fake(vm))
    got = requests.get(
        f"{served.url}{API}/samplers/{sampler.sampler_id}", headers={"X-API-Key": KEY_B}, timeout=10
    )
    unknown = requests.get(f"{served.url}{API}/samplers/{fake(sampler.sampler_id)}", headers={"X-API-Key": KEY_B}, timeout=10)  # fmt: skip
    assert got.status_code == 404 and answer(got, sampler.sampler_id) == answer(
        unknown, fake(sampler.sampler_id)
    )
    body = {"session_id": own_session, "sampling_session_seq_id": 4, "model_path": snapshot}
    got = post(served, KEY_B, "create_sampling_session", body)
    unknown = post(served, KEY_B, "create_sampling_session", {**body, "model_path": fake(snapshot)})
    assert got.status_code == 404 and answer(got, snapshot) == answer(unknown, fake(snapshot))
    got = requests.post(
        f"{served.url}{API}/sessions/{session}/finish", json={}, headers={"X-API-Key": KEY_B}, timeout=10
    )
    unknown = requests.post(f"{served.url}{API}/sessions/{fake(session)}/finish", json={}, headers={"X-API-Key": KEY_B}, timeout=10)  # fmt: skip
    assert got.status_code == 404 and answer(got, session) == answer(unknown, fake(session))

    # the victim's checkpoint path names nothing in the attacker's namespace
    made_up = re.sub(r"/weights/.*", "/weights/nothing", ckpt)
    for path in (ckpt, made_up):
        with pytest.raises(tinker.RequestFailedError, match=f"no saved state at {re.escape(path)}"):
            attacker.load_state(path).result()
        with pytest.raises(tinker.RequestFailedError, match=f"no saved state at {re.escape(path)}"):
            attacker_sc.create_training_client_from_state(path).result()

    attacker.save_state("mine").result()  # the same name, in its own namespace
    tenants = sorted(p.name for p in (served.root / "out" / "tinker").iterdir())
    assert len(tenants) == 2 and all(re.fullmatch(r"t-[0-9a-f]{16}", t) for t in tenants)  # hashes, not keys
    assert same(before, slot_state(served, vm)), "the victim's slot changed"
    assert ckpt_file.read_bytes() == ckpt_bytes
    assert vm in served.state.backend.models and session in served.state.registry.sessions
    # the victim still has all of it: its held result, its sampler, its model
    retrieved = post(served, KEY_A, "retrieve_future", {"request_id": held_rid})
    assert retrieved.status_code == 200 and retrieved.headers["content-type"].startswith(
        "application/x-protobuf"
    )
    victim.forward_backward([sft(TEXT)], "cross_entropy").result()

    # a second client on the victim's key is the same tenant, but cannot learn or guess its ids
    shared = shared_sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    sm = shared.get_info().model_id
    boot = served.state.mint.boot
    assert sm.split(":")[0] != session and sm.split(":")[0].split("-")[1] == session.split("-")[1] == boot
    assert sm.split(":")[0].split("-")[2] != session.split("-")[2]  # 128 random bits each
    for guess in (f"{sm.split(':')[0]}:train:1", fake(sm.split(":")[0]) + ":train:0"):
        assert post(served, KEY_A, "get_info", {"model_id": guess}).status_code == 404
    tail = held_rid.split("-")[2]
    for guess in (f"req-{boot}-{int(tail, 16) + 1:032x}", f"req-{boot}-{int(tail, 16) - 1:032x}", "req-1"):
        assert post(served, KEY_A, "retrieve_future", {"request_id": guess}).status_code == 404
    for sc in (victim_sc, shared_sc, attacker_sc):
        sc.close("success").result()
    wait_for(lambda: not served.state.backend.models)  # every slot back


def test_a_wrong_key_is_a_401(served: Served) -> None:
    for headers in ({}, {"X-API-Key": "tml-nobody"}, {"X-API-Key": KEY_A[:-1]}):
        refused = requests.post(f"{served.url}{API}/create_session", json={}, headers=headers, timeout=10)
        assert refused.status_code == 401 and refused.json()["category"] == "user"


# ---------------------------------------------------------------------------- bounded serving
def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(served: Served) -> None:
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    received = bytearray()

    def read(conn: socket.socket) -> None:  # takes the answer as soon as it comes
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                received.extend(chunk)

    start_rss, sent = rss(), 0
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as conn:
        reader = threading.Thread(target=read, args=(conn,))
        reader.start()
        conn.sendall(
            f"POST {API}/forward_backward HTTP/1.1\r\nHost: t\r\nX-API-Key: {KEY_A}\r\n"
            "Content-Type: application/x-protobuf\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"%x\r\n" % 65536 + b"\0" * 65536 + b"\r\n"
        with contextlib.suppress(OSError):
            while sent < 200 << 20 and not received:  # up to 200 MiB, as the attack sent
                conn.sendall(chunk)
                sent += len(chunk)
        reader.join(timeout=30)
    reply = bytes(received)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"larger than the limit of 1048576 bytes" in reply
    assert sent < 32 << 20, sent  # refused after about 1 MiB (plus what the sockets buffer)
    assert rss() - start_rss < 64 << 20
    # a declared length over the limit is refused before a byte of it is read
    big = requests.post(
        f"{served.url}{API}/forward_backward", data=b"", timeout=10,
        headers={"X-API-Key": KEY_A, "Content-Length": str(200 << 20)},
    )  # fmt: skip
    assert big.status_code == 413 and big.json()["category"] == "user"


def test_a_huge_forward_backward_runs_in_batches_beside_a_small_one(served: Served) -> None:
    big_sc, small_sc = client(served, KEY_A), client(served, KEY_B)
    big = big_sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    small = small_sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    rng = np.random.default_rng(0)
    huge = [sft(rng.integers(0, 128, 256).tolist()) for _ in range(60)]  # 15,300 tokens, 30 batches of 510
    small.forward_backward([sft(TEXT)], "cross_entropy").result()  # warm
    queue = served.state.queue
    times: dict[str, float] = {}

    def run_huge() -> None:
        start = time.perf_counter()
        out = big.forward_backward(huge, "cross_entropy").result()
        times["huge"] = time.perf_counter() - start
        times["huge_done"] = time.perf_counter()
        assert out.metrics["num_tokens:sum"] == 60 * 255 and len(out.loss_fn_outputs) == 60

    before = len(queue.batches)
    thread = threading.Thread(target=run_huge)
    thread.start()
    wait_for(lambda: len(queue.batches) >= before + 2)  # the huge request is running
    start = time.perf_counter()
    small.forward_backward([sft(TEXT)], "cross_entropy").result()
    times["small"], small_done = time.perf_counter() - start, time.perf_counter()
    thread.join(timeout=300)
    assert len(queue.batches) - before >= 30
    assert small_done < times["huge_done"], times  # it did not wait for the whole huge request
    assert times["small"] < times["huge"] / 4, times

    # the caps, with the settings that set them
    over = [sft(rng.integers(0, 128, 256).tolist()) for _ in range(65)]  # 16,575 tokens
    with pytest.raises(tinker.BadRequestError, match="tinker.max_forward_backward_tokens"):
        big.forward_backward(over, "cross_entropy").result()
    sampler = small.save_weights_and_get_sampling_client().result()
    prompt = tinker.ModelInput.from_ints(TEXT[:4])
    with pytest.raises(tinker.BadRequestError, match="tinker.max_sample_tokens"):
        sampler.sample(prompt, num_samples=64, sampling_params=tinker.SamplingParams(max_tokens=64)).result()
    # a sample request over sample_batch_tokens runs in parts and comes back whole
    out = sampler.sample(
        prompt, num_samples=16, sampling_params=tinker.SamplingParams(max_tokens=64, seed=3)
    ).result()
    assert len(out.sequences) == 16 and all(len(s.tokens) == len(s.logprobs) for s in out.sequences)
    big_sc.close("success").result()
    small_sc.close("success").result()


# ---------------------------------------------------------------------------- errors and results
def test_malformed_input_is_a_400_naming_the_field_and_changes_nothing(served: Served) -> None:
    sc = client(served, KEY_A)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    model_id = tc.get_info().model_id
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler_id = next(s.sampler_id for s in served.state.registry.samplers.values() if s.model_id == model_id)
    before = slot_state(served, model_id)

    def refused(response: requests.Response, field: str) -> None:
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["category"] == "user" and body["field"] == field and field in body["detail"], body

    n = len(TEXT) - 1
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.weights: must be finite"):
        tc.forward_backward([sft(TEXT, [1.0] * (n - 1) + [float("nan")])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="must be finite numbers; got inf"):
        tc.forward_backward([sft(TEXT, [float("inf")] * n)], "cross_entropy").result()
    fractional = sft(TEXT, targets_dtype=np.float32)
    fractional.loss_fn_inputs["target_tokens"] = tensor([1.7] + TEXT[2:], np.float32)
    with pytest.raises(
        tinker.BadRequestError, match=r"target_tokens: token ids must be whole numbers; got 1\.7"
    ):
        tc.forward_backward([fractional], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"sampling_params\.temperature"):
        sampler.sample(
            tinker.ModelInput.from_ints(TEXT[:3]), 1, tinker.SamplingParams(temperature=-1.0)
        ).result()

    good = fb_body(model_id, [sft(TEXT)])
    refused(post(served, KEY_A, "forward_backward", raw=b"\xff\xfe not a protobuf"), "body")
    message = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sft(TEXT)], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1))  # fmt: skip
    message.data[0].model_input[0].encoded_text.tokens = b"\x01\x02\x03"  # not whole int32s
    refused(post(served, KEY_A, "forward_backward", raw=message.SerializeToString()), "data[0].model_input")
    message = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sft(TEXT)], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1))  # fmt: skip
    message.data[0].loss_fn_inputs["weights"].dtype = 77
    refused(
        post(served, KEY_A, "forward_backward", raw=message.SerializeToString()),
        "data[0].loss_fn_inputs.weights",
    )
    message = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sft(TEXT)], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1))  # fmt: skip
    message.loss_fn = "custom"  # the one SDK loss this server does not serve
    refused(post(served, KEY_A, "forward_backward", raw=message.SerializeToString()), "loss_fn")
    message.loss_fn = "ppo"
    message.loss_fn_config_v2["clip_low_threshold"].number = float("nan")
    refused(
        post(served, KEY_A, "forward_backward", raw=message.SerializeToString()),
        "loss_fn_config.clip_low_threshold",
    )
    assert post(served, KEY_A, "forward_backward", raw=good).status_code == 200  # the good one still works

    sample = {"sampling_session_id": sampler_id, "num_samples": 1, "seq_id": 1,
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:3]}]}}  # fmt: skip
    for params, field in (
        ({"temperature": "hot"}, "sampling_params.temperature"),
        ({"temperature": 1e-40}, "sampling_params.temperature"),
        ({"max_tokens": 1.5}, "sampling_params.max_tokens"),
        ({"top_p": 2}, "sampling_params.top_p"),
        ({"top_k": 0}, "sampling_params.top_k"),
        ({"top_k": 10**30}, "sampling_params.top_k"),  # overflowed the engine call it shared with others
        ({"top_k": 10**6}, "sampling_params.top_k"),  # beyond the model's vocabulary
        ({"stop": [10**6]}, "sampling_params.stop"),
        ({"stop": [1.5]}, "sampling_params.stop"),  # token ids and strings are stops; a float is not
    ):
        refused(post(served, KEY_A, "asample", {**sample, "sampling_params": params}), field)
    refused(
        post(served, KEY_A, "asample", {**sample, "num_samples": 0, "sampling_params": {}}), "num_samples"
    )
    refused(
        post(served, KEY_A, "asample", {**sample, "prompt": {"chunks": [{"tokens": [1, 9999]}]}}), "prompt"
    )
    refused(
        post(served, KEY_A, "asample", {**sample, "prompt": {"chunks": [{"tokens": [1.5]}]}}),
        "prompt.chunks[0].tokens",
    )
    adam = {"model_id": model_id, "seq_id": 1}
    refused(
        post(served, KEY_A, "optim_step", {**adam, "adam_params": {"learning_rate": -1}}),
        "adam_params.learning_rate",
    )
    refused(
        post(served, KEY_A, "optim_step", {**adam, "adam_params": {"learning_rate": 1e-3, "beta1": 1.5}}),
        "adam_params.beta1",
    )
    refused(
        post(served, KEY_A, "optim_step", {**adam, "adam_params": {"learning_rate": 1e-3, "eps": 0.0}}),
        "adam_params.eps",
    )
    refused(post(served, KEY_A, "optim_step", {**adam, "adam_params": None}), "adam_params")
    nan = requests.post(
        f"{served.url}{API}/optim_step", data=b'{"model_id": "x", "adam_params": {"learning_rate": NaN}}',
        headers={"X-API-Key": KEY_A, "Content-Type": "application/json"}, timeout=10,
    )  # fmt: skip
    refused(nan, "<body>")
    refused(post(served, KEY_A, "save_weights", {"model_id": model_id, "path": "../../etc"}), "path")
    refused(
        post(served, KEY_A, "load_weights", {"model_id": model_id, "path": "/etc/passwd", "optimizer": True}),
        "path",
    )
    refused(
        post(served, KEY_A, "create_model", {"session_id": model_id.split(":")[0], "model_seq_id": "x"}),
        "model_seq_id",
    )
    not_json = requests.post(
        f"{served.url}{API}/get_info", data=b"{", headers={"X-API-Key": KEY_A}, timeout=10
    )
    refused(not_json, "<body>")
    assert same(before, slot_state(served, model_id))  # none of it changed anything
    sc.close("success").result()


def test_dedup_needs_a_seq_id_and_a_retrieved_result_is_released(served: Served) -> None:
    sc = client(served, KEY_A)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    model_id = tc.get_info().model_id
    entry = served.state.backend.model(model_id)
    step = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}

    def run(body: dict[str, Any]) -> str:
        rid = post(served, KEY_A, "optim_step", body).json()["request_id"]
        result = post(served, KEY_A, "retrieve_future", {"request_id": rid})
        assert result.status_code == 200 and "metrics" in result.json(), result.text
        return rid

    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    steps = entry.version
    first, second = run(step), run(step)  # no seq_id: no dedup key, both run
    assert first != second and entry.version == steps + 2
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    third, retry = run({**step, "seq_id": 41}), run({**step, "seq_id": 41})
    assert third == retry and entry.version == steps + 3  # a retry of one seq_id runs once
    # retrieved results are released after tinker.retrieved_result_ttl_s (1 s here)
    wait_for(
        lambda: "error" in post(served, KEY_A, "retrieve_future", {"request_id": third}).json(), timeout=10
    )
    gone = post(served, KEY_A, "retrieve_future", {"request_id": third}).json()
    assert gone["category"] == "user" and "released 1 s after it was retrieved" in gone["error"]
    assert post(served, KEY_B, "retrieve_future", {"request_id": third}).status_code == 404
    sc.close("success").result()


def test_a_seq_id_reused_with_another_body_is_a_400_and_never_the_first_answer(served: Served) -> None:
    """The same (model, seq_id) with a different body (3 datums where the first sent 2) is a 400
    naming seq_id and the first request, and changes no state; the identical body is a retry that
    gets the first request's id and result."""
    sc = client(served, KEY_A)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    model_id = tc.get_info().model_id
    before = slot_state(served, model_id)
    two = post(served, KEY_A, "forward_backward", raw=fb_body(model_id, [sft(TEXT)] * 2, seq_id=77))
    rid = two.json()["request_id"]
    retry = post(served, KEY_A, "forward_backward", raw=fb_body(model_id, [sft(TEXT)] * 2, seq_id=77))
    assert retry.json()["request_id"] == rid
    three = post(served, KEY_A, "forward_backward", raw=fb_body(model_id, [sft(TEXT)] * 3, seq_id=77))
    assert three.status_code == 400 and three.json()["field"] == "seq_id", three.text
    assert f"seq_id 77 on {model_id!r} was already used by request {rid!r}" in three.json()["detail"]
    result = post(served, KEY_A, "retrieve_future", {"request_id": rid})
    assert result.status_code == 200
    assert len(deserialize_forward_backward_output(result.content).loss_fn_outputs) == 2  # the first body's
    optim = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}, "seq_id": 78}
    assert post(served, KEY_A, "optim_step", optim).status_code == 200
    changed = post(served, KEY_A, "optim_step", {**optim, "adam_params": {"learning_rate": 1.0}})
    assert changed.status_code == 400 and "differs from this one's in adam_params" in changed.json()["detail"]
    wait_for(lambda: served.state.backend.model(model_id).version == 1, timeout=30)  # one step, lr 1e-3
    assert not same(slot_state(served, model_id), before)
    sc.close("success").result()


# ---------------------------------------------------------------------------- restart and expiry
def test_a_future_polled_across_a_restart_gets_the_restart_error(served: Served) -> None:
    sc = client(served, KEY_A)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("survives").result().path
    saved = slot_state(served, tc.get_info().model_id)
    busy, gate = threading.Event(), threading.Event()
    served.state.queue.submit(lambda: (busy.set(), gate.wait(60)))  # the next request stays queued
    try:
        busy.wait(30)
        future = tc.optim_step(tinker.AdamParams(learning_rate=1e-2))  # the SDK long-polls it
        wait_for(lambda: served.state.queue.pending() == 1)
        threading.Timer(0.5, gate.set).start()
        served.restart(session_timeout_s=2, max_sessions=2)
    finally:
        gate.set()
    with pytest.raises(tinker.RequestFailedError, match="the server restarted since this request was made"):
        future.result(timeout=120)
    with pytest.raises(tinker.NotFoundError, match="server restarted since it was created"):
        tc.forward_backward([sft(TEXT)], "cross_entropy").result(timeout=60)

    # saved states survive, in their tenant's namespace
    again = client(served, KEY_A)
    restored = again.create_training_client_from_state_with_optimizer(path).result()
    assert same(saved, slot_state(served, restored.get_info().model_id))
    other = client(served, KEY_B)
    with pytest.raises(tinker.RequestFailedError, match="no saved state at"):
        other.create_training_client_from_state(path).result()
    again.close("success").result()
    other.close("success").result()
    sc.close("success")  # its session is gone with the restart


def test_a_silent_session_expires_and_frees_its_slot(served: Served) -> None:
    assert served.state.settings.session_timeout_s == 2  # set by the restart above
    sc = client(served, KEY_B)  # its heartbeat comes every 10 s: silent for longer than 2 s
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    model_id = tc.get_info().model_id
    assert model_id in served.state.backend.models
    wait_for(lambda: model_id not in served.state.backend.models, timeout=20)
    with pytest.raises(tinker.NotFoundError, match=r"its session ended \(no heartbeat or request for 2 s"):
        tc.forward_backward([sft(TEXT)], "cross_entropy").result(timeout=60)
    # the open sessions of a tenant are capped (tinker.max_sessions = 2 here)
    opened = [post(served, KEY_B, "create_session", {}) for _ in range(3)]
    assert [r.status_code for r in opened] == [200, 200, 429]
    assert "tinker.max_sessions" in opened[2].json()["detail"]
    assert post(served, KEY_A, "create_session", {}).status_code == 200  # per tenant
    sc.close("success")


def test_without_a_key_file_loopback_clients_are_one_tenant(served: Served) -> None:
    served.restart(api_key_file=None)
    sc = tinker.ServiceClient(base_url=served.url, api_key="tml-anything")
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    out = tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    assert out.metrics["num_tokens:sum"] == len(TEXT) - 1
    assert {m.tenant for m in served.state.registry.models.values()} == {"local"}
    sc.close("success").result()


def test_idle_connections_are_closed_and_make_room(served: Served) -> None:
    # the serving shared with the controller's API (tests/unit/test_http_admission.py: both doors)
    served.restart(max_connections=3, max_connections_per_peer=3, head_timeout_s=0.5)
    url = f"{served.url}{API}/get_server_capabilities"
    idle = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(3)]
    try:  # the server is full of idle connections: the oldest makes room
        assert requests.get(url, headers={"X-API-Key": KEY_A}, timeout=10).status_code == 200
        for conn in idle:
            assert conn.recv(1) == b""  # closed (for room, or after head_timeout_s: it never sent)
    finally:
        for conn in idle:
            conn.close()
