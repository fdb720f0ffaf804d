"""The API token comes from the environment or an owner-only file, never from the config."""

from __future__ import annotations

import pytest

from miles_multilora.api_token import TOKEN_ENV, read_token
from miles_multilora.config.run import config_from_container, to_yaml
from miles_multilora.errors import ConfigError


def test_token_from_an_owner_only_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert read_token(None) == "from-env"
    path = tmp_path / "token"
    path.write_text("from-file\n")
    path.chmod(0o600)
    assert read_token(path) == "from-file"
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token(path)
    path.write_text("")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="empty"):
        read_token(path)
    monkeypatch.delenv(TOKEN_ENV)
    assert read_token(None) is None


def test_the_config_has_no_token_key_and_never_records_one(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    with pytest.raises(ConfigError, match="token"):
        config_from_container({"controller": {"token": "s3cret"}})
    cfg = config_from_container({"controller": {"token_file": "/run/secrets/mm_token"}})
    assert "s3cret" not in to_yaml(cfg) and "token_file: /run/secrets/mm_token" in to_yaml(cfg)
