"""The controller Ray actor: named + namespaced, reachable from a second driver process,
detached in service mode, serving HTTP, restarting from its state_dir."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")

from miles_multilora.controller import AdapterConflictError, ControllerUnavailableError  # noqa: E402
from miles_multilora.controller.actor import (  # noqa: E402
    DEFAULT_NAME,
    DEFAULT_NAMESPACE,
    get_controller,
    get_or_create_controller,
)
from miles_multilora.controller.client import ControllerClient  # noqa: E402
from miles_multilora.controller.endpoint import read_endpoint  # noqa: E402
from miles_multilora.controller.snapshot import AdapterResult  # noqa: E402
from miles_multilora.errors import ConfigError, SpecError  # noqa: E402

# Token auth is on by default for a new local cluster (ray.init sets RAY_AUTH_MODE=token for this
# process and its children). The token comes from RAY_AUTH_TOKEN, which second drivers inherit;
# without it Ray would write ~/.ray/auth_token, shared by every cluster of this user.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def spec(name: str, **overrides) -> dict:
    return {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 5, **overrides}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A private local Ray cluster with its own auth token (passed to second drivers by env)."""
    saved = {k: os.environ.get(k) for k in (*RAY_ENV, "RAY_AUTH_MODE")}
    os.environ.update(RAY_ENV)
    # Ray caches the token a process first used: every cluster this process starts must share it,
    # so the token is set once per process (as miles_multilora's start_ray does) and left set.
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    temp_dir = f"/tmp/ray_ctrl_{os.getpid()}"
    context = ray.init(
        address="local",
        _temp_dir=temp_dir,
        include_dashboard=False,
        num_cpus=2,
        log_to_driver=False,
    )
    yield context.address_info["gcs_address"]
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run_second_driver(gcs_address: str, body: str, env: dict[str, str] | None = None) -> dict:
    """Run ``body`` in a fresh python process connected to the cluster; it prints one JSON line."""
    header = f"import json, ray\nray.init(address={gcs_address!r}, log_to_driver=False)\n"
    code = header + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_named_actor_serves_the_core_http_and_a_second_driver(cluster, tmp_path):
    handle = get_or_create_controller(num_slots=2, max_rank=16, state_dir=tmp_path, detached=True)
    try:
        url = ray.get(handle.url.remote())
        assert read_endpoint(tmp_path) == {"url": url, "name": DEFAULT_NAME, "namespace": DEFAULT_NAMESPACE}
        assert ray.get(handle.register.remote(spec("from_ray")))["state"] == "PENDING"
        with pytest.raises(SpecError) as info:  # the actor's SpecError arrives as a SpecError
            ray.get(handle.register.remote(spec("too_big", rank=64)))
        assert info.value.key == "rank"
        with pytest.raises(AdapterConflictError):
            ray.get(handle.register.remote(spec("from_ray")))
        ControllerClient(url).submit(spec("from_http"))

        # same name + namespace -> the same actor; a mismatched shape is refused
        assert ray.get(get_or_create_controller(2, 16, state_dir=tmp_path).url.remote()) == url
        with pytest.raises(ConfigError, match="num_slots"):
            get_or_create_controller(num_slots=3, max_rank=16)

        seen = run_second_driver(
            cluster,
            """
            from miles_multilora.controller.actor import get_controller
            from miles_multilora.errors import SpecError
            handle = get_controller("multilora_controller", "miles_multilora")
            names = [r["name"] for r in ray.get(handle.list.remote())]
            run_id = ray.get(handle.register.remote(
                {"name": "from_driver2", "dataset": {"task": "basic_arithmetic"}, "num_steps": 2}))["run_id"]
            try:
                ray.get(handle.register.remote({"name": "bad/name"}))
                field = None
            except SpecError as exc:
                field = exc.key
            print(json.dumps({"url": ray.get(handle.url.remote()), "names": names, "run_id": run_id,
                              "field": field}))
            """,
        )
        assert seen["url"] == url and seen["names"] == ["from_ray", "from_http"]
        assert seen["field"] == "name" and seen["run_id"].startswith("from_driver2")

        snap = ray.get(handle.snapshot.remote())
        assert [(a.name, a.slot) for a in snap.running] == [("from_ray", 0), ("from_http", 1)]
        ray.get(handle.report_step.remote({"from_ray": AdapterResult(trained=True, checkpoint="/ck/r/1")}))
        assert ray.get(handle.get.remote("from_ray"))["step"] == 1
        assert ray.get(handle.get.remote("from_driver2"))["state"] == "PENDING"

        # a crashed actor is restarted by Ray and restores its state from state_dir
        old_pid = ray.get(handle.config.remote())["pid"]
        ray.kill(handle, no_restart=False)
        deadline = time.time() + 60
        while True:
            try:
                if ray.get(handle.config.remote(), timeout=30)["pid"] != old_pid:
                    break
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError,
            ):
                pass
            assert time.time() < deadline, "controller actor did not come back"
            time.sleep(0.5)
        records = {r["name"]: r for r in ray.get(handle.list.remote())}
        assert records["from_ray"]["state"] == "RUNNING" and records["from_ray"]["step"] == 1
        (resumed, *_) = ray.get(handle.snapshot.remote()).running
        assert (resumed.name, resumed.needs_init, resumed.resume_checkpoint) == ("from_ray", True, "/ck/r/1")
        new_url = ray.get(handle.url.remote())
        assert read_endpoint(tmp_path)["url"] == new_url
        assert ControllerClient(new_url).status("from_driver2")["state"] == "PENDING"
    finally:
        ray.kill(handle)


def test_detached_controller_outlives_the_driver_that_created_it(cluster, tmp_path):
    token_file = tmp_path / "auth_token"  # second form of passing the token: a token file
    token_file.write_text(os.environ["RAY_AUTH_TOKEN"])
    created = run_second_driver(
        cluster,
        """
        from miles_multilora.controller.actor import get_or_create_controller
        kept = get_or_create_controller(1, 8, name="svc_detached", namespace="ctrl_test", detached=True)
        gone = get_or_create_controller(1, 8, name="svc_attached", namespace="ctrl_test", detached=False)
        print(json.dumps({"url": ray.get(kept.url.remote())}))
        """,
        env={"RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": str(token_file)},
    )
    handle = get_controller("svc_detached", "ctrl_test")
    try:
        assert ray.get(handle.url.remote()) == created["url"]
        assert ControllerClient(created["url"]).health()["num_slots"] == 1
        deadline = time.time() + 30
        while True:  # the non-detached one dies with its driver
            try:
                get_controller("svc_attached", "ctrl_test")
            except ControllerUnavailableError:
                break
            assert time.time() < deadline, "non-detached controller outlived its driver"
            time.sleep(0.5)
        with pytest.raises(ControllerUnavailableError, match="namespace 'elsewhere'"):
            get_controller("svc_detached", "elsewhere")
    finally:
        ray.kill(handle)
