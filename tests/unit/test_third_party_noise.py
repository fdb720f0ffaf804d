"""The known third-party notices are hidden in one place, and nothing else is: the package's own
warnings and unknown third-party ones still show, and MILES_MULTILORA_SHOW_WARNINGS shows all."""

from __future__ import annotations

import os
import subprocess
import sys

from miles_multilora import third_party_noise

SCRIPT = r"""
import logging, sys, warnings
from miles_multilora import third_party_noise
third_party_noise.install()
third_party_noise.install()  # idempotent
logging.basicConfig(stream=sys.stderr, format="LOG %(name)s: %(message)s")
def warn(message, category, module):
    warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module=module)
warn("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.backends")
warn("Transformer Engine and Apex are not installed. X", UserWarning, "megatron.core.optimizer")
warn("full scope is deprecated. Use empty cuda_graph_scope", UserWarning, "megatron.core.transformer")
warn("Apex is not installed. Falling back to Torch Norm", UserWarning, "someone_else.module")
warn("a warning of our own", UserWarning, "miles_multilora.rl.step")
logging.getLogger("transformers.configuration_utils").warning("`torch_dtype` is deprecated! Use `dtype`")
logging.getLogger("transformers.configuration_utils").warning("another transformers message")
logging.getLogger("math_verify.grader").warning("Timeout is disabled as timeout_seconds is None")
"""


def _stderr(show: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != third_party_noise.SHOW_ENV}
    env["PYTHONWARNINGS"] = "default"
    if show:
        env[third_party_noise.SHOW_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_only_the_known_notices_are_hidden() -> None:
    err = _stderr(show=False)
    assert "megatron" not in err and "torch_dtype" not in err and "Timeout is disabled" not in err, err
    assert "someone_else" in err  # the same text from another package still shows
    assert "a warning of our own" in err
    assert "another transformers message" in err


def test_show_warnings_shows_everything() -> None:
    err = _stderr(show=True)
    for text in (
        "Apex is not installed",
        "Transformer Engine and Apex",
        "full scope",
        "torch_dtype",
        "Timeout",
    ):
        assert text in err, (text, err)
