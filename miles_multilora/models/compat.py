"""Every CPU-vs-GPU difference of this package lives here, one comment per item.

Megatron-core and megatron-bridge are written for CUDA machines with Transformer Engine. On a
CPU machine (this project's CI and default demo) they work with the small shims below; on a GPU
machine the shims are no-ops.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import ipaddress
import os
import socket
import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def is_cpu() -> bool:
    """True when no CUDA device is usable: the whole package then runs on CPU with gloo."""
    return not torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cpu") if is_cpu() else torch.device("cuda", torch.cuda.current_device())


# 1. megatron-core allocates parameters and buffers with `device=torch.cuda.current_device()`.
#    On CPU we make that call answer the CPU device, so those allocations land on the CPU.
def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight^T`` (``[..., H]`` by ``[V, H]``) as fp32 logits, never rounded to the model's
    dtype: a bf16 logit near 20 is off by up to 0.06, which alone moves the sampler's and the
    trainer's logprobs apart. A CUDA GEMM reads the bf16 operands and writes fp32 (``out_dtype``); a
    CPU has no such kernel, so it multiplies fp32 copies (CPU runs are fp32 by default)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        out = flat @ weight.t()
    elif hidden.is_cuda:
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    else:
        out = flat.float() @ weight.float().t()
    return out.view(*hidden.shape[:-1], weight.shape[0])


def patch_cuda_current_device() -> None:
    if is_cpu() and not getattr(torch.cuda.current_device, "_miles_cpu_patch", False):

        def _cpu_current_device() -> torch.device:
            return torch.device("cpu")

        _cpu_current_device._miles_cpu_patch = True  # type: ignore[attr-defined]
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


# 7. megatron-core builds its default causal mask with `device="cuda"`; on CPU we build it on
#    the CPU instead (patched where it is defined and where the softmax imported it). Only the
#    unfused attention path uses it; a few lengths are cached (each is sq x sq bytes: 1 GiB at 32k).
def patch_causal_mask() -> None:
    if not is_cpu():
        return
    import functools

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    if getattr(utils.get_default_causal_mask, "_miles_cpu_patch", False):
        return

    @functools.lru_cache(maxsize=4)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    get_default_causal_mask._miles_cpu_patch = True  # type: ignore[attr-defined]
    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


# 8. Megatron's activation recompute (tensor_parallel.checkpoint) saves and restores the CUDA RNG
#    state around the recomputed forward. On CPU there is none: the CPU generator's state stands in
#    (the models here have no dropout, so nothing random happens inside a layer anyway).
def patch_checkpoint_rng() -> None:
    if not is_cpu():
        return
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(tp_random._get_cuda_rng_state, "_miles_cpu_patch", False):
        return

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    get_state._miles_cpu_patch = True  # type: ignore[attr-defined]
    tp_random._get_cuda_rng_state = get_state
    tp_random._set_cuda_rng_state = set_state


# 9. Megatron runs a fused RoPE only through Transformer Engine's function (``apply_rope_fusion``);
#    without TE that hook is empty. On a GPU with Triton we fill it with our kernel (models/fused_rope);
#    on CPU the unfused RoPE runs. Returns whether a fused RoPE is available (the config flag).
def install_fused_rope() -> bool:
    if is_cpu():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    from miles_multilora.models import fused_rope

    if rope_utils.fused_apply_rotary_pos_emb is None and fused_rope.HAVE_TRITON:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope.apply_rope
    return rope_utils.fused_apply_rotary_pos_emb is not None


# 13. Megatron skips its QKV split (``config.fused_single_qkv_rope``) only through Transformer Engine's
#     ``apply_fused_qkv_rotary_pos_emb``; without TE that hook is missing. On a GPU with Triton we fill
#     it with our kernel (models/fused_qkv_rope); on CPU the split and the unfused RoPE run. Returns
#     whether the hook is there (the config flag may then be set for an eligible model).
def install_fused_qkv_rope() -> bool:
    if is_cpu():
        return False
    from megatron.core.transformer import attention

    from miles_multilora.models import fused_qkv_rope

    if not attention.HAVE_FUSED_QKV_ROPE and fused_qkv_rope.HAVE_TRITON:
        attention.apply_fused_qkv_rotary_pos_emb = fused_qkv_rope.apply_fused_qkv_rope
        attention.HAVE_FUSED_QKV_ROPE = True
    return attention.HAVE_FUSED_QKV_ROPE


# 10. megatron-core 0.16's MoE router names Transformer Engine's GEMM (``te_general_gemm``) in its
#     gating function but defines it only when TE imports; without TE (this project's local spec,
#     CPU or GPU) the name is missing. We define it as None, the value its own check expects.
def patch_moe_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# 11. Megatron's all-to-all MoE token dispatcher copies its split sizes to the host on a CUDA side
#     stream (created when the first dispatcher is built). On CPU every tensor is already on the
#     host: there is no stream, and the sizes become NumPy arrays as the GPU path makes them.
def patch_moe_alltoall_cpu() -> None:
    if not is_cpu():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    if getattr(Dispatcher._maybe_dtoh_and_synchronize, "_miles_cpu_patch", False):
        return

    def to_host(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    to_host._miles_cpu_patch = True  # type: ignore[attr-defined]
    Dispatcher._maybe_dtoh_and_synchronize = to_host
    Dispatcher.cuda_dtoh_stream = "cpu"  # no side stream is made (the class builds one when None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# 2. torch.distributed: gloo on CPU, nccl on GPU. A process started without a launcher
#    (no RANK/WORLD_SIZE in the environment) becomes a world of one.
def init_process_group(rank: int | None = None, world_size: int | None = None) -> None:
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        port = int(os.environ["MASTER_PORT"])
    elif world_size > 1:
        raise RuntimeError("MASTER_PORT must be set for a multi-process run")
    else:  # a world of one: a fresh port each time (the last world's store may not be gone yet)
        port = free_port()
    backend = "gloo" if is_cpu() else "nccl"
    if not is_cpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    elif ipaddress.ip_address(socket.gethostbyname(os.environ["MASTER_ADDR"])).is_loopback:
        # a world on one machine: gloo's pair sockets on loopback too, not on the host's address
        if "lo" in {name for _, name in socket.if_nameindex()}:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = _rendezvous_store(os.environ["MASTER_ADDR"], port, rank, world_size)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)


def _rendezvous_store(host: str, port: int, rank: int, world_size: int) -> dist.TCPStore:
    """The world's TCPStore on ``host:port``. Rank 0 serves it from a socket bound to ``host``
    only (torch's own server would listen on every interface of the host)."""
    timeout = timedelta(seconds=float(os.environ.get("MILES_RENDEZVOUS_TIMEOUT_S", 300)))
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(info[4])
    sock.listen(max(128, world_size))
    # the store owns the socket from here (it closes the descriptor when it is destroyed)
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=sock.detach()
    )


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    ep: int = 1,
) -> None:
    """Set up torch.distributed, megatron parallel_state and the model-parallel RNG (idempotent).

    ``ep``: expert parallelism (MoE experts split over ``ep`` ranks of the data-parallel group,
    expert tensor parallelism 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    patch_cuda_current_device()
    patch_causal_mask()
    patch_checkpoint_rng()
    patch_moe_without_te()
    patch_moe_alltoall_cpu()
    init_process_group(rank, world_size)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_pipeline_model_parallel_world_size() != pp
            or parallel_state.get_expert_model_parallel_world_size() != ep
        ):
            raise RuntimeError("model parallel already initialised with a different tp/pp/ep")
    else:
        # 3. On CPU the gloo backend carries every group (megatron creates its NCCL-style groups
        #    with the default backend, which is gloo here).
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,  # experts whole on each rank (module docstring: MoE)
        )
    # 4. The model-parallel RNG tracker forks CUDA RNG states; the "inference" tracker keeps
    #    plain CPU generators, which is what a CPU run needs. On GPU the normal tracker is used.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=is_cpu(), force_reset_rng=True)
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# 5. megatron-bridge 0.3.1 imports Transformer Engine and Triton at module level although its
#    HF<->Megatron weight conversion does not need them. When they are missing (CPU), we satisfy
#    those imports with inert placeholder modules *only while the bridge imports*: any use of a
#    placeholder class raises, and the placeholders are removed from sys.modules afterwards so
#    megatron-core, torch and others still see that TE/Triton are absent.
class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator: @triton.jit
            return args[0]
        if not args:  # decorator factory: @triton.autotune(configs=...)
            return lambda fn: fn
        raise RuntimeError(f"{cls.__name__} needs Transformer Engine / Triton, which is not installed")


class _Placeholder(metaclass=_PlaceholderMeta):
    pass


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = _PlaceholderMeta(name, (_Placeholder,), {})
        setattr(self, name, placeholder)
        return placeholder


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


@contextlib.contextmanager
def _placeholder_imports(roots: tuple[str, ...]) -> Iterator[None]:
    missing = {r for r in roots if importlib.util.find_spec(r) is None}
    if not missing:
        yield
        return
    finder = _PlaceholderFinder(missing)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in missing]:
            del sys.modules[name]


def import_auto_bridge() -> Any:
    """Import and return megatron-bridge's ``AutoBridge`` on CPU or GPU."""
    patch_cuda_current_device()
    # Import megatron-core's GPT stack first, so it records the true absence of TE/Triton.
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    with _placeholder_imports(("transformer_engine", "triton")):
        from megatron.bridge import AutoBridge
    return AutoBridge


# 6. megatron-bridge scatters TP shards with torch.distributed.scatter; on gloo a non-contiguous
#    shard (a view of the full tensor) is sent wrongly. We make every shard contiguous.
def patch_bridge_contiguous_scatter() -> None:
    from megatron.bridge.models.conversion import param_mapping

    cls = param_mapping.MegatronParamMapping
    if getattr(cls.scatter_to_tp_ranks, "_miles_contiguous", False):
        return
    original = cls.scatter_to_tp_ranks

    def scatter_to_tp_ranks(self: Any, splits: Any, *args: Any, **kwargs: Any) -> Any:
        if splits is not None:
            splits = [s.contiguous() for s in splits]
        return original(self, splits, *args, **kwargs)

    scatter_to_tp_ranks._miles_contiguous = True  # type: ignore[attr-defined]
    cls.scatter_to_tp_ranks = scatter_to_tp_ranks


# 12. megatron-bridge 0.3.1 turns a rank's local expert numbers into global ones (expert
#     parallelism) only for grouped-GEMM expert names (``experts.linear_fc1.weight{i}``); the local
#     spec's SequentialMLP names its experts ``experts.local_experts.{i}``, so every EP rank would load
#     (and export) the first experts. We translate those names the same way.
def patch_bridge_sequential_experts() -> None:
    import re

    from megatron.bridge.models.conversion import model_bridge

    original = model_bridge._megatron_local_name_to_global
    if getattr(original, "_miles_local_experts", False):
        return
    local_expert = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")

    def local_name_to_global(models: Any, config: Any, param_name: str, vp_stage: Any = None) -> str:
        param_name = original(models, config, param_name, vp_stage)
        from megatron.core import parallel_state

        group = parallel_state.get_expert_model_parallel_group()
        match = local_expert.search(param_name)
        if match is None or group is None or group.size() == 1:
            return param_name
        per_rank = config.num_moe_experts // group.size()
        number = per_rank * group.rank() + int(match.group(1))
        return f"{param_name[: match.start()]}.mlp.experts.local_experts.{number}.{param_name[match.end() :]}"

    local_name_to_global._miles_local_experts = True  # type: ignore[attr-defined]
    model_bridge._megatron_local_name_to_global = local_name_to_global
