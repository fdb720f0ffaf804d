"""One Tinker-server run for ``test_tinker_dp.py``: serve the tiny model on ``model.dp`` = argv[1]
trainer ranks (in this process and spawned followers), drive it with the official SDK (two models
trained, stepped, scored and sampled) and write what came back as JSON to argv[2]. argv[1] ``kill``:
two ranks, the follower killed between two calls."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import tinker

from miles_multilora.config.run import config_from_container
from miles_multilora.launch.tinker_ranks import start
from tests.e2e.conftest import sft_datum

KEY = "tml-dp-test-key"
TEXTS = [
    [5, 17, 33, 9, 60, 2, 44, 71, 8],
    [19, 90, 3, 27, 64, 12],
    [7, 7, 80, 41, 3, 3, 99],
    [11, 22, 33, 44],
]


def kill_a_follower(server: object) -> dict[str, str | bool]:
    """Train once, kill rank 1 (SIGKILL), train again: the error the client gets; then stop."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8).result()
    tc.forward_backward([sft_datum(TEXTS[0])], "cross_entropy").result()
    follower = server.state.backend._followers[0]
    os.kill(follower.pid, signal.SIGKILL)
    follower.join()
    try:
        tc.forward_backward([sft_datum(TEXTS[0])], "cross_entropy").result()
        error = ""
    except tinker.RequestFailedError as exc:
        error = str(exc)
    server.stop()
    return {"error": error, "stopped": not server.alive}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dp = 2 if mode == "kill" else int(mode)
    root = Path(tempfile.mkdtemp(prefix=f"tinker_dp{dp}_"))
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    cfg = config_from_container({
        "model": {"source": "tiny", "dp": dp, "tiny": {"hidden_size": 64, "ffn_hidden_size": 128}},
        "lora": {"num_slots": 2, "max_rank": 8}, "trainer": {"output_dir": str(root / "out"), "micro_batch_size": 8},
        "tinker": {"port": 0, "api_key_file": str(key_file), "base_model": "tiny", "batch_window_s": 0.05},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    server = start(cfg)
    if mode == "kill":
        out.write_text(json.dumps(kill_a_follower(server)))
        return
    result: dict[str, list] = {"losses": [], "forward": [], "samples": [], "prompt_logprobs": []}
    result["dp_size"] = [server.state.backend.rank.layout.dp_size]
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        clients = [sc.create_lora_training_client(base_model="tiny", rank=8, seed=s).result() for s in (1, 2)]
        data = [sft_datum(t) for t in TEXTS]
        for _ in range(2):
            for i, tc in enumerate(clients):
                out_fb = tc.forward_backward(data[i:] + data[:i], "cross_entropy").result()
                result["losses"].append(out_fb.metrics["loss:sum"])
                tc.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
        for tc in clients:
            fwd = tc.forward(data, "cross_entropy").result()
            result["forward"].append([list(map(float, o["logprobs"].data)) for o in fwd.loss_fn_outputs])
            sampler = tc.save_weights_and_get_sampling_client().result()
            params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
            got = sampler.sample(prompt=tinker.ModelInput.from_ints(TEXTS[0][:4]), num_samples=4,
                                 sampling_params=params).result()  # fmt: skip
            result["samples"].append([[list(s.tokens), list(map(float, s.logprobs))] for s in got.sequences])
            lp = sampler.compute_logprobs(tinker.ModelInput.from_ints(TEXTS[1])).result()
            result["prompt_logprobs"].append([x for x in lp if x is not None])
        sc.close("success")
    finally:
        server.stop()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
