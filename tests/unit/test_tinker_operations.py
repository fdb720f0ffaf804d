"""Which backend calls every trainer rank of a multi-rank Tinker server runs: every public method
of the backend that is not marked ``@reads``, found from the class itself (no list kept by hand),
so an operation added to the backend is mirrored to the follower ranks without anyone listing it."""

from __future__ import annotations

from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.operations import operations, reads


def test_every_public_method_not_marked_reads_is_an_operation() -> None:
    class Backend:
        def train(self) -> None: ...

        @reads
        def look(self) -> int:
            return 0

        def _helper(self) -> None: ...

        @property
        def models(self) -> list[str]:
            return []

    class Grown(Backend):  # a method added later is mirrored without being listed anywhere
        def prefetch(self) -> None: ...

    assert operations(Backend) == {"train"}
    assert operations(Grown) == {"train", "prefetch"}


def test_the_backend_s_state_changing_calls_are_its_operations_and_its_checks_stay_on_rank_0() -> None:
    assert operations(TinkerBackend) == {
        "create_model", "unload_model", "load_copy", "drop_copy", "save_sampler_weights", "forward_backward",
        "optim_step", "sample", "sample_many", "score_prompt", "score_samples", "save_state", "export_peft",
        "load_state",
    }  # fmt: skip
    for read in ("model", "lora_targets", "check_new_model", "stamp", "has_room", "check", "check_scoring"):
        assert read not in operations(TinkerBackend)
