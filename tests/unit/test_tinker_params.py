"""A Tinker request's numbers are bounded where it arrives (a 400 naming the field, nothing queued):
what the engine and the optimizer can hold, strictly typed."""

from __future__ import annotations

import pytest

from miles_multilora.errors import SpecError
from miles_multilora.tinker import params
from miles_multilora.tinker.losses import check_loss
from miles_multilora.tinker.requests import TinkerError


def sample_body(**sampling_params: object) -> dict:
    return {"prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": sampling_params}


@pytest.mark.parametrize(
    ("sampling_params", "key", "hint"),
    [
        ({"top_k": 10**30}, "sampling_params.top_k", "-1 (off) or 1..2147483647"),
        ({"top_k": 0}, "sampling_params.top_k", "-1 (off)"),
        ({"max_tokens": 10**30}, "sampling_params.max_tokens", "1..131072"),
        ({"temperature": 1e6}, "sampling_params.temperature", "limit of 100"),
        ({"stop": [2**40]}, "sampling_params.stop", "0..2147483647"),
        ({"stop": ["x"] * 17}, "sampling_params.stop", "at most 16"),
    ],
)
def test_sampling_params_out_of_range_are_refused(sampling_params, key, hint):
    with pytest.raises(TinkerError) as info:
        params.sampling(sample_body(**sampling_params))
    assert info.value.key == key and hint in info.value.message, info.value


@pytest.mark.parametrize(
    ("adam_params", "key", "hint"),
    [
        ({"eps": 0.0}, "adam_params.eps", "(0, 1]"),
        ({"eps": -1e-8}, "adam_params.eps", "(0, 1]"),
        ({"beta1": 1.0}, "adam_params.beta1", "[0, 1)"),
        ({"beta2": 1.0}, "adam_params.beta2", "[0, 1)"),
        ({"learning_rate": 10.0}, "adam_params.learning_rate", "[0, 1]"),
        ({"weight_decay": 1e4}, "adam_params.weight_decay", "lr * weight_decay"),
        ({"grad_clip_norm": 1e300}, "adam_params.grad_clip_norm", "[0, 1e+06]"),
    ],
)
def test_adam_params_the_optimizer_cannot_apply_are_refused(adam_params, key, hint):
    body = {"adam_params": {"learning_rate": 1e-2, **adam_params}}
    with pytest.raises(TinkerError) as info:
        params.adam(body)
    assert info.value.key == key and hint in info.value.message, info.value
    assert params.adam({"adam_params": {"learning_rate": 0.0}})["eps"] == 1e-12  # the SDK's defaults


def test_loss_config_must_be_finite():
    with pytest.raises(SpecError, match="loss_fn_config.clip_high_threshold: must be a finite number"):
        check_loss("ppo", {"clip_high_threshold": float("inf")})


def test_age_recipients_are_parsed_capped_and_encrypt_every_file(tmp_path):
    """``age_encryption_recipients``: age and SSH public keys, at most ``tinker.max_age_recipients``;
    every exported file is replaced by ``<file>.age``, which each recipient's identity decrypts."""
    pyrage = pytest.importorskip("pyrage")
    from miles_multilora.tinker import age_export

    ids = [pyrage.x25519.Identity.generate() for _ in range(2)]
    body = {"age_encryption_recipients": [str(i.to_public()) for i in ids]}
    to = age_export.recipients(body, limit=2)
    assert len(to) == 2 and age_export.recipients({}, limit=2) == []
    for bad, key, hint in (
        ({"age_encryption_recipients": "age1x"}, "age_encryption_recipients", "must be a list"),
        ({"age_encryption_recipients": ["age1nope"]}, "age_encryption_recipients[0]", "not an age recipient"),
        ({"age_encryption_recipients": ["ssh-ed25519 AAAA"]}, "age_encryption_recipients[0]", "ssh-ed25519"),
        ({"age_encryption_recipients": body["age_encryption_recipients"] * 2}, "age_encryption_recipients",
         "tinker.max_age_recipients"),
    ):  # fmt: skip
        with pytest.raises(TinkerError) as info:
            age_export.recipients(bad, limit=2)
        assert info.value.key == key and hint in info.value.message
    (tmp_path / "sub").mkdir()
    files = {"adapter_config.json": b'{"r": 4}', "sub/adapter_model.safetensors": bytes(range(256)) * 4}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    age_export.encrypt_dir(tmp_path, to)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        f"{name}.age" for name in files
    )
    for name, data in files.items():
        sealed = (tmp_path / f"{name}.age").read_bytes()
        assert data not in sealed
        assert all(pyrage.decrypt(sealed, [identity]) == data for identity in ids)
