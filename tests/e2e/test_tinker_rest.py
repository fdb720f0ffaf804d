"""The SDK's REST surface (``RestClient``) against a real ``tinker-serve``: training runs with their
``user_metadata``, checkpoints listed, deleted, expired by ``ttl_seconds``, published and exported as
a PEFT adapter downloaded by signed URL; sessions; another tenant sees none of it (404, like a
missing id); and a restart keeps runs and checkpoints.

One server for the module (two tenants, the fixture of ``test_tinker_tenants``), with a 1 s minimum
TTL and a 0.2 s sweep so that expiry is observable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from safetensors.torch import load as load_safetensors

tinker = pytest.importorskip("tinker")
from tests.e2e.test_tinker_tenants import KEY_A, KEY_B, TEXT, Served, serving, sft, wait_for  # noqa: E402

REST = {"min_checkpoint_ttl_s": 1, "checkpoint_sweep_interval_s": 0.2}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serving(tmp_path_factory.mktemp("tinker_rest"), **REST)


@pytest.fixture(scope="module")
def trained(served: Served) -> Iterator[dict[str, Any]]:
    """Tenant A's session (with metadata) and one trained run with a training, a sampler and an
    external checkpoint; tenant B's session with a run of its own."""
    sc_a = tinker.ServiceClient(base_url=served.url, api_key=KEY_A, user_metadata={"team": "a"})
    sc_b = tinker.ServiceClient(base_url=served.url, api_key=KEY_B)
    tc = sc_a.create_lora_training_client(
        base_model="tiny", rank=4, seed=3, user_metadata={"experiment": "rest-1"}
    ).result()
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("step1", user_metadata={"step": "1"}).result().path
    sampler = tc.save_weights_for_sampler("samp1").result().path
    external = tc.save_weights_external("peft1").result().path
    tc_b = sc_b.create_lora_training_client(base_model="tiny", rank=2, seed=4).result()
    with warnings.catch_warnings():  # deprecated in 0.38.0 for RestClient(...), still served
        warnings.simplefilter("ignore", FutureWarning)
        rest_a = sc_a.create_rest_client()
    yield {
        "sc_a": sc_a, "sc_b": sc_b, "tc": tc, "tc_b": tc_b, "run": state.split("/")[2],
        "state": state, "sampler": sampler, "external": external,
        "rest_a": rest_a, "rest_b": tinker.RestClient(base_url=served.url, api_key=KEY_B),
    }  # fmt: skip
    for sc in (sc_a, sc_b):
        sc.close("success")


def test_runs_are_listed_and_got_with_their_user_metadata(trained: dict[str, Any]) -> None:
    rest, run = trained["rest_a"], trained["run"]
    got = rest.get_training_run(run).result()
    assert (got.training_run_id, got.base_model, got.lora_rank, got.is_lora) == (run, "tiny", 4, True)
    assert got.user_metadata == {"experiment": "rest-1"}
    assert got.last_checkpoint is not None and got.last_checkpoint.tinker_path == trained["state"]
    assert (
        got.last_sampler_checkpoint is not None
        and got.last_sampler_checkpoint.tinker_path == trained["sampler"]
    )
    by_model = rest.get_training_run(trained["tc"].model_id).result()  # the SDK's model id names it too
    assert by_model.training_run_id == run

    listed = rest.list_training_runs(limit=1).result()
    assert [r.training_run_id for r in listed.training_runs] == [run]  # A's only run (B's is not A's)
    assert (listed.cursor.offset, listed.cursor.limit, listed.cursor.total_count) == (0, 1, 1)
    assert rest.list_training_runs(limit=1, offset=1).result().training_runs == []
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_training_runs(limit=0).result()


def test_checkpoints_are_listed_per_run_and_across_runs(served: Served, trained: dict[str, Any]) -> None:
    rest, run = trained["rest_a"], trained["run"]
    listed = rest.list_checkpoints(run).result()
    kinds = {c.tinker_path: c.checkpoint_type for c in listed.checkpoints}
    assert kinds == {
        trained["state"]: "training",
        trained["sampler"]: "sampler",
        trained["external"]: "external",
    }
    state = next(c for c in listed.checkpoints if c.checkpoint_type == "training")
    assert state.checkpoint_id == "weights/step1" and state.user_metadata == {"step": "1"}
    assert state.size_bytes and state.size_bytes > 0 and state.expires_at is None and not state.public
    everything = rest.list_user_checkpoints(limit=2).result()
    assert len(everything.checkpoints) == 2 and everything.cursor.total_count == 3
    rest_page = rest.list_user_checkpoints(limit=2, offset=2).result().checkpoints
    assert {c.tinker_path for c in everything.checkpoints + rest_page} == set(kinds)
    raw = requests.get(f"{served.url}/api/v1/checkpoints", headers={"X-API-Key": KEY_A}, timeout=10).json()
    assert raw["usage"] == {  # the key's checkpoints against its quotas (tinker.max_checkpoint_bytes_per_tenant)
        "checkpoints": 3, "max_checkpoints": 10_000,
        "bytes": sum(c.size_bytes or 0 for c in listed.checkpoints), "max_bytes": 100 * 2**30,
    }  # fmt: skip
    info = rest.get_weights_info_by_tinker_path(trained["state"]).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)


def test_the_external_weights_are_a_peft_adapter_downloaded_by_signed_url(trained: dict[str, Any]) -> None:
    urls = trained["rest_a"].get_external_weights_urls(trained["external"]).result()
    assert set(urls.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    files = {}
    for name, url in urls.urls.items():
        with urllib.request.urlopen(url, timeout=30) as response:  # no API key, as the CLI fetches
            files[name] = response.read()
    config = json.loads(files["adapter_config.json"])
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    tensors = load_safetensors(files["adapter_model.safetensors"])
    assert tensors and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in tensors)
    assert {t.shape[0] for k, t in tensors.items() if "lora_A" in k} == {4}
    tampered = urls.urls["adapter_config.json"].replace("token=", "token=x")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(tampered, timeout=30)
    assert refused.value.code == 403


def test_another_tenant_cannot_list_get_delete_or_download(served: Served, trained: dict[str, Any]) -> None:
    rest_b, run, sc_a = trained["rest_b"], trained["run"], trained["sc_a"]
    for attempt in (
        lambda: rest_b.get_training_run(run).result(),
        lambda: rest_b.list_checkpoints(run).result(),
        lambda: rest_b.delete_checkpoint_from_tinker_path(trained["state"]).result(),
        lambda: rest_b.get_external_weights_urls(trained["external"]).result(),
        lambda: rest_b.get_weights_info_by_tinker_path(trained["state"]).result(),
        lambda: rest_b.publish_checkpoint_from_tinker_path(trained["state"]).result(),
        lambda: rest_b.set_checkpoint_ttl_from_tinker_path(trained["state"], 5).result(),
        lambda: rest_b.get_session(sc_a.holder.get_session_id()).result(),
    ):
        with pytest.raises(tinker.NotFoundError):
            attempt()
    # answered exactly like a run nobody has
    headers = {"X-API-Key": KEY_B}
    theirs = requests.get(f"{served.url}/api/v1/training_runs/{run}", headers=headers, timeout=10)
    nobody = requests.get(f"{served.url}/api/v1/training_runs/{run[:-1]}x", headers=headers, timeout=10)
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["detail"].replace(run, "<id>") == nobody.json()["detail"].replace(
        run[:-1] + "x", "<id>"
    )
    mine = {r.training_run_id for r in rest_b.list_training_runs().result().training_runs}
    assert run not in mine and len(mine) == 1
    assert all(
        not c.tinker_path.startswith(f"tinker://{run}/")
        for c in rest_b.list_user_checkpoints().result().checkpoints
    )
    assert sc_a.holder.get_session_id() not in rest_b.list_sessions().result().sessions
    assert len(trained["rest_a"].list_checkpoints(run).result().checkpoints) == 3  # nothing deleted


def test_sessions_show_their_runs_samplers_and_metadata(trained: dict[str, Any]) -> None:
    rest, sid = trained["rest_a"], trained["sc_a"].holder.get_session_id()
    got = rest.get_session(sid).result()
    assert got.training_run_ids == [trained["run"]] and got.user_metadata == {"team": "a"}
    assert sid in rest.list_sessions().result().sessions


def test_a_published_checkpoint_is_loadable_by_others_but_not_listed(trained: dict[str, Any]) -> None:
    rest_a, path, sc_b = trained["rest_a"], trained["state"], trained["sc_b"]
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        sc_b.create_training_client_from_state(path).result()
    rest_a.publish_checkpoint_from_tinker_path(path).result()
    rest_a.publish_checkpoint_from_tinker_path(path).result()  # again: it stays public, no error
    assert next(
        c for c in rest_a.list_checkpoints(trained["run"]).result().checkpoints if c.tinker_path == path
    ).public
    loaded = sc_b.create_training_client_from_state(path).result()
    assert loaded.get_info().lora_rank == 4
    assert trained["rest_b"].get_weights_info_by_tinker_path(path).result().lora_rank == 4
    with pytest.raises(tinker.NotFoundError):
        trained["rest_b"].list_checkpoints(trained["run"]).result()
    rest_a.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        sc_b.create_training_client_from_state(path).result()


def test_a_deleted_checkpoint_is_gone_and_loading_it_fails_clearly(
    served: Served, trained: dict[str, Any]
) -> None:
    tc, rest = trained["tc"], trained["rest_a"]
    path = tc.save_state("doomed").result().path
    files = next((served.root / "out" / "tinker").rglob("weights/*/doomed"))
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(trained["run"]).result().checkpoints}
    assert not files.exists()
    with pytest.raises(tinker.RequestFailedError, match="no saved state at .*doomed"):
        trained["sc_a"].create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(path).result()


def test_a_checkpoint_past_its_ttl_is_swept(served: Served, trained: dict[str, Any]) -> None:
    tc, rest, run = trained["tc"], trained["rest_a"], trained["run"]
    path = tc.save_state("brief", ttl_seconds=1).result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert listed[path].expires_at is not None
    files = next((served.root / "out" / "tinker").rglob("weights/*/brief"))
    wait_for(lambda: path not in {c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints}, 20)
    assert not files.exists()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        tc.save_state("bad", ttl_seconds=0).result()


def test_a_restart_keeps_runs_and_checkpoints(served: Served, trained: dict[str, Any]) -> None:
    run = trained["run"]
    before = {c.tinker_path for c in trained["rest_a"].list_checkpoints(run).result().checkpoints}
    served.restart(**REST)
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    try:
        rest = tinker.RestClient(base_url=served.url, api_key=KEY_A)
        got = rest.get_training_run(run).result()
        assert got.user_metadata == {"experiment": "rest-1"} and got.lora_rank == 4
        after = {c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints}
        assert after == before  # sampler weights too: they are on disk
        assert {trained["state"], trained["external"], trained["sampler"]} <= after
        loaded = sc.create_training_client_from_state(trained["state"]).result()
        assert loaded.get_info().lora_rank == 4
    finally:
        sc.close("success")


def test_the_tinker_cli_lists_and_downloads_a_checkpoint(served: Served, trained: dict[str, Any]) -> None:
    """``tinker checkpoint download`` of a training checkpoint: a new session loads it, exports it as
    external weights (ttl 1 h), downloads each file by its signed URL and deletes the export."""
    cli = Path(sys.executable).parent / "tinker"
    if not cli.exists():
        pytest.skip("the tinker CLI is not installed beside this Python")
    env = {**os.environ, "TINKER_BASE_URL": served.url, "TINKER_API_KEY": KEY_A}
    out = served.root / "download"

    def run(*args: str) -> str:
        done = subprocess.run([str(cli), *args], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = json.loads(run("--format", "json", "checkpoint", "list", "--run-id", trained["run"]))
    assert trained["state"] in json.dumps(listed)
    run("checkpoint", "download", trained["state"], "-o", str(out))
    (folder,) = out.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    left = [c.tinker_path for c in trained["rest_a"].list_user_checkpoints().result().checkpoints]
    assert not [p for p in left if p.endswith("/external_weights/download")]  # the CLI deleted its export


def test_the_cookbooks_weights_download_decrypts_a_training_checkpoint(
    served: Served, trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cookbook's ``weights.download`` at its defaults: a new session loads the training
    checkpoint, exports it age-encrypted to a key made for the download (every file ``<name>.age``),
    decrypts the files with pyrage and deletes the export. The adapter is the plain export's."""
    weights = pytest.importorskip("tinker_cookbook.weights")
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    out = served.root / "cookbook_download"
    weights.download(tinker_path=trained["state"], output_dir=str(out), base_url=served.url)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    plain = trained["rest_a"].get_external_weights_urls(trained["external"]).result().urls
    for name, url in plain.items():  # the same step's plain export
        with urllib.request.urlopen(url, timeout=30) as response:
            assert (out / name).read_bytes() == response.read(), name
    left = [c.tinker_path for c in trained["rest_a"].list_user_checkpoints().result().checkpoints]
    assert not [p for p in left if p.endswith("/external_weights/download")]  # deleted after the download
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)  # a live model: a restart may have run
    try:
        model_id = sc.create_lora_training_client(base_model="tiny", rank=2).result().model_id
        bad = {"model_id": model_id, "path": "enc", "age_encryption_recipients": ["age1nope"]}
        refused = requests.post(
            f"{served.url}/api/v1/save_weights_external", json=bad, headers={"X-API-Key": KEY_A}, timeout=10
        )
    finally:
        sc.close("success")
    assert refused.status_code == 400 and "age_encryption_recipients[0]" in refused.json()["detail"]
