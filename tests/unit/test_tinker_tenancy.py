"""The Tinker door's bookkeeping on its own: the key file and tenants, ids, ownership of sessions,
models and samplers, and the held results (dedup keys, release after retrieval or a TTL, the
per-tenant memory cap and the cap on requests in flight). Time is a clock the test advances."""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from pathlib import Path

import pytest

from miles_multilora.errors import ConfigError
from miles_multilora.tinker.futures import Busy, FutureStore, Gone, Outcome, SeqIdReused
from miles_multilora.tinker.ids import IdMint
from miles_multilora.tinker.registry import Registry, Sampler, Unknown
from miles_multilora.tinker.tenants import ANONYMOUS, KeyRing, read_key_file, tenant_id


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_key_file_one_key_per_line_each_its_own_tenant(tmp_path: Path) -> None:
    path = key_file(tmp_path, "# team a\ntml-alpha\n\n  tml-beta  \n# old: tml-gamma\n")
    keys = read_key_file(path)
    assert keys == ["tml-alpha", "tml-beta"]
    ring = KeyRing(keys)
    a, b = ring.tenant_of("tml-alpha"), ring.tenant_of(b"tml-beta")
    assert a == tenant_id("tml-alpha") and b == tenant_id("tml-beta") and a != b
    assert re.fullmatch(r"t-[0-9a-f]{16}", a) and "alpha" not in a  # names a directory, hides the key
    assert ring.tenant_of("tml-gamma") is None and ring.tenant_of("") is None and ring.tenant_of(None) is None
    assert KeyRing(None).tenant_of(None) == ANONYMOUS  # loopback without keys: one tenant

    for text, message in (
        ("tml-a\nsecret\n", "line 2: keys must start with 'tml-'"),
        ("tml-a\ntml-a\n", "line 2: this key is listed twice"),
        ("tml-a b\n", "without spaces"),
        ("# nothing\n\n", "holds no key"),
    ):
        with pytest.raises(ConfigError, match=message):
            read_key_file(key_file(tmp_path, text))
    with pytest.raises(ConfigError, match="chmod 600"):
        read_key_file(key_file(tmp_path, "tml-a\n", mode=0o644))


def test_ids_are_random_and_know_their_server_start() -> None:
    mint, later = IdMint(), IdMint()
    ids = {mint.new("req") for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"req-[0-9a-f]{12}-[0-9a-f]{32}", i) for i in ids)
    assert mint.boot != later.boot
    one = next(iter(ids))
    assert later.from_earlier_start(one) and not mint.from_earlier_start(one)
    assert later.from_earlier_start(f"sess-{mint.boot}-{'0' * 32}:train:0")
    assert not later.from_earlier_start("req-1") and not later.from_earlier_start("")


def test_another_tenants_objects_answer_like_unknown_ones() -> None:
    clock = Clock()
    registry = Registry(IdMint(), clock=clock)
    mine = registry.open_session("t-a")
    model = registry.add_model("t-a", mine.session_id, f"{mine.session_id}:train:0")
    registry.add_sampler(Sampler(f"{mine.session_id}:sample:0", "t-a", mine.session_id, model.model_id, 0))
    assert registry.model("t-a", model.model_id) is model
    assert model.run_id.startswith("run-") and mine.session_id not in model.run_id

    def refusal(tenant: str, lookup: str, some_id: str) -> str:
        with pytest.raises(Unknown) as info:
            getattr(registry, lookup)(tenant, some_id)
        return info.value.message.replace(some_id, "<id>")

    for lookup, some_id in (("session", mine.session_id), ("model", model.model_id),
                            ("sampler", f"{mine.session_id}:sample:0")):  # fmt: skip
        assert refusal("t-b", lookup, some_id) == refusal("t-b", lookup, some_id[:-1] + "x")
    with pytest.raises(Unknown):
        registry.end_session("t-b", mine.session_id, "finished by its client")
    with pytest.raises(Unknown):
        registry.add_model("t-b", mine.session_id, f"{mine.session_id}:train:1")
    assert registry.model("t-a", model.model_id) is model  # untouched

    # a lookup keeps the session alive; silence past the timeout expires it
    clock.now += 50
    registry.model("t-a", model.model_id)
    clock.now += 50
    assert registry.expired(60) == []
    clock.now += 20
    assert registry.expired(60) == [mine]
    assert registry.end_session("t-a", mine.session_id, "no heartbeat") == [model.model_id]
    assert "its session ended (no heartbeat)" in refusal("t-a", "model", model.model_id)
    assert refusal("t-b", "model", model.model_id) == "unknown model '<id>'"  # the owner alone hears why
    restarted = Registry(IdMint(), clock=clock)
    assert "server restarted" in str(pytest.raises(Unknown, restarted.model, "t-a", model.model_id).value)


def done(value: bytes) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def raw(future: Future) -> Outcome:
    return Outcome(future.result(), "application/octet-stream")


def test_a_seq_id_reused_with_another_body_is_refused_and_an_identical_retry_deduplicated() -> None:
    """A retry resends its body: the same body gets the first request's id (it runs once); another
    body under the held key is a 400 naming the first request and the fields that differ, and
    changes nothing (it never gets the first request's answer)."""
    store = FutureStore(IdMint(), max_pending=2)
    started: list[bytes] = []

    def start(value: bytes) -> Future:
        started.append(value)
        return Future()  # still running: the key is held

    key = ("t-a", "m1", "sample", 3)
    body = {"sampling_session_id": "m1", "seq_id": 3, "num_samples": 2, "prompt": {"tokens": [1, 2]}}
    first = store.submit("t-a", key, lambda: start(b"a"), raw, body=body)
    assert store.submit("t-a", key, lambda: start(b"b"), raw, body=dict(body)) == first  # a retry
    with pytest.raises(SeqIdReused) as info:
        store.submit("t-a", key, lambda: start(b"c"), raw, body={**body, "num_samples": 3})
    assert info.value.key == "seq_id"
    message = info.value.message
    assert f"sample seq_id 3 on 'm1' was already used by request {first!r}" in message
    assert "differs from this one's in num_samples" in message and "new seq_id" in message
    proto = store.submit("t-a", ("t-a", "m1", "forward_backward", 3), lambda: start(b"d"), raw,
                         body={"forward_backward_input": b"\x01\x02"})  # fmt: skip
    with pytest.raises(SeqIdReused, match="differs from this one's in forward_backward_input"):
        store.submit("t-a", ("t-a", "m1", "forward_backward", 3), lambda: start(b"e"), raw,
                     body={"forward_backward_input": b"\x01\x03"})  # fmt: skip
    assert started == [b"a", b"d"] and len(store) == 2 and proto != first  # the refusals changed nothing
    with pytest.raises(Busy):  # max_pending 2: the refusals took no place in the tenant's queue
        store.submit("t-a", None, lambda: start(b"f"), raw)


def test_results_dedup_by_key_and_are_released_after_retrieval_or_a_ttl() -> None:
    clock = Clock()
    store = FutureStore(IdMint(), result_ttl_s=100, retrieved_ttl_s=10, clock=clock)
    started: list[int] = []

    def start(value: bytes) -> Future:
        started.append(1)
        return done(value)

    key = ("t-a", "model", "optim_step", 7)
    first = store.submit("t-a", key, lambda: start(b"x"), raw)
    assert store.submit("t-a", key, lambda: start(b"y"), raw) == first and len(started) == 1  # a retry
    other = store.submit("t-b", ("t-b", "model", "optim_step", 7), lambda: start(b"z"), raw)
    plain = [store.submit("t-a", None, lambda: start(b"w"), raw) for _ in range(2)]  # no seq_id: both run
    assert len(started) == 4 and len({first, other, *plain}) == 4
    with pytest.raises(Unknown, match="unknown request_id"):
        store.get("t-b", first)  # another tenant's id is unknown to it
    entry = store.get("t-a", first)
    assert entry.ready.result().body == b"x"

    store.retrieved(entry)
    clock.now += 9
    store.sweep()
    assert store.get("t-a", first) is entry  # a client whose reply was lost may poll again
    clock.now += 2
    store.sweep()
    with pytest.raises(Gone, match="released 10 s after it was retrieved") as info:
        store.get("t-a", first)
    assert info.value.category == "user"
    with pytest.raises(Unknown):
        store.get("t-b", first)
    again = store.submit("t-a", key, lambda: start(b"v"), raw)  # released: the key runs anew
    assert again != first and len(started) == 5

    clock.now += 101  # never retrieved
    store.sweep()
    with pytest.raises(Gone, match="never retrieved within tinker.result_ttl_s"):
        store.get("t-a", plain[0])
    assert len(store) == 0 and store.held_bytes("t-a") == store.held_bytes("t-b") == 0
    with pytest.raises(Gone, match="server restarted") as info:
        FutureStore(IdMint()).get("t-a", first)
    assert info.value.category == "server"


def test_held_results_have_a_memory_cap_per_tenant_and_requests_in_flight_a_count_cap() -> None:
    store = FutureStore(IdMint(), max_held_bytes=1000, max_pending=2)
    a = [store.submit("t-a", None, lambda: done(b"a" * 400), raw) for _ in range(2)]
    b = store.submit("t-b", None, lambda: done(b"b" * 400), raw)
    store.retrieved(store.get("t-a", a[1]))
    a.append(store.submit("t-a", None, lambda: done(b"a" * 400), raw))  # 1200 > 1000: one goes
    with pytest.raises(Gone, match="passed tinker.max_held_results_mb"):
        store.get("t-a", a[1])  # the retrieved one first
    assert store.get("t-a", a[0]) and store.get("t-a", a[2]) and store.held_bytes("t-a") == 800
    assert store.get("t-b", b).ready.result().body == b"b" * 400  # another tenant's are not touched

    slow = [Future(), Future()]
    running = [store.submit("t-c", None, lambda f=f: f, raw) for f in slow]
    with pytest.raises(Busy, match="tinker.max_pending_requests"):
        store.submit("t-c", None, lambda: Future(), raw)
    assert store.submit("t-d", None, lambda: done(b"d"), raw)  # the cap is per tenant
    slow[0].set_result(b"c")
    assert store.get("t-c", running[0]).ready.result().body == b"c"
    assert store.submit("t-c", None, lambda: done(b"c"), raw)  # room again
