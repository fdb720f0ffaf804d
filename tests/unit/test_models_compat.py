"""The torch.distributed rendezvous listens on MASTER_ADDR only, not on every interface."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_multilora.models import compat


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc shows them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).is_file():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.append(local.rsplit(":", 1)[0])
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc/net")
def test_the_rendezvous_store_binds_the_master_address_only(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.destroy_distributed()
    port = compat.free_port()
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(port))
    try:
        compat.init_process_group(rank=0, world_size=1)
        assert _listeners(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
    finally:
        compat.destroy_distributed()
    assert _listeners(port) == []  # the store's socket went with the process group
