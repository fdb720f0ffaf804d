"""Test-wide settings: CPU threads, offline hubs, GPU-only tests skipped without CUDA, Triton
kernels interpreted on the CPU when there is no GPU."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Run the Triton kernels with Triton's CPU interpreter (read when the kernels are defined).
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("TRITON_INTERPRET") == "1":
    from miles_multilora.testing.lora import patch_triton_interpreter  # noqa: E402

    patch_triton_interpreter()


def pytest_configure(config: pytest.Config) -> None:
    from miles_multilora.third_party_noise import KNOWN_WARNINGS, install

    for known in KNOWN_WARNINGS:  # the CLI's list, as pytest filters (pytest resets filters per test)
        config.addinivalue_line("filterwarnings", known.ini_line())
    install()  # and the known log records


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Official-SDK clients of servers the tests have stopped keep heartbeating from daemon threads
    # until the interpreter exits; their "Session heartbeat failed" warnings after the summary say
    # nothing about the run (during the tests they still show).
    logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.ERROR)
