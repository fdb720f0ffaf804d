"""One slot's saved state, one file per TP rank: the format of RL checkpoints and Tinker saved states.

``<dir>/slot_rank{r}.pt`` holds TP rank ``r``'s exact slot tensors (``"slot"``, see
:func:`~miles_multilora.lora.slots.slot_state`), its optimizer state (``"optimizer"``) and the slot's
:class:`SlotMeta` (``"meta"``: its owner's name, LoRA rank, alpha, seed and weight version). Written
atomically (a ``.part`` file renamed into place) and read with ``torch.load(weights_only=True)``:
tensors and plain values only. Shards written before ``meta`` existed (RL checkpoints) have none.

A shard keeps each layer's A and B (and their optimizer moments and fp32 masters) at the layer's
own LoRA rank, not the slot's ``max_rank`` (:func:`trim_to_rank`); loading pads them back with
zeros (:func:`pad_optimizer`), which is what the slot holds beyond its rank.

With expert parallelism (``model.ep`` = n > 1) the experts' tensors and moments are not in the TP
shards: ``<dir>/experts_ep{e}of{n}.pt`` holds EP rank ``e``'s (experts are whole on each rank). A
state saved at one EP size loads at any other that divides its experts: :func:`read_shard` joins
the saved experts and takes this rank's. Given the model's :class:`~miles_multilora.trainer.tp_reshard.TPSplit`,
it loads a state saved at another TP size too (:mod:`~miles_multilora.trainer.tp_reshard`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from miles_multilora.errors import SpecError
from miles_multilora.lora import MultiLoRAExpertLinear, multi_lora_layers
from miles_multilora.private_files import private_open
from miles_multilora.trainer.tp_reshard import MOMENTS, TPSplit, resplit, saved_tp_size


@dataclass(frozen=True)
class SlotMeta:
    """What a saved slot was: its owner's name, LoRA rank, alpha, init seed, weight version and the
    module families it trains (``targets``; None in shards written before slots had targets)."""

    name: str
    rank: int
    alpha: float
    seed: int
    version: int
    targets: tuple[str, ...] | None = None


def _rank_dim(name: str) -> int | None:
    """The LoRA-rank dimension of a slot tensor named ``<layer>.lora_A`` / ``<layer>.lora_B``."""
    if name.endswith(".lora_A"):
        return -2
    if name.endswith(".lora_B"):
        return -1
    return None


def _trim(tensors: dict[str, torch.Tensor], ranks: dict[str, int], copy: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        dim, layer = _rank_dim(name), name.rsplit(".", 1)[0]
        if dim is not None and layer in ranks:
            t = t.narrow(dim, 0, ranks[layer])
            out[name] = t.clone() if copy else t
        else:
            out[name] = t
    return out


def trim_to_rank(
    slot: dict[str, torch.Tensor], optimizer: dict, copy: bool = True
) -> tuple[dict[str, torch.Tensor], dict]:
    """``slot`` tensors and ``optimizer`` state cut to each layer's own rank (``<layer>.rank``);
    ``copy=False``: the cut tensors are views (the caller copies them)."""
    ranks = {name[: -len(".rank")]: int(t) for name, t in slot.items() if name.endswith(".rank")}
    optimizer = {
        k: (_trim(v, ranks, copy) if k in ("exp_avg", "exp_avg_sq", "master") else v)
        for k, v in optimizer.items()
    }
    return _trim(slot, ranks, copy), optimizer


def pad_optimizer(optimizer: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """``optimizer`` state whose rank-cut tensors are zero-padded to ``shapes`` (name -> full shape)."""

    def pad(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            full = shapes.get(name)
            if full is None or tuple(t.shape) == tuple(full) or len(full) != t.dim():
                out[name] = t
                continue
            padded = t.new_zeros(full)
            padded[tuple(slice(0, n) for n in t.shape)] = t
            out[name] = padded
        return out

    return {k: (pad(v) if k in ("exp_avg", "exp_avg_sq", "master") else v) for k, v in optimizer.items()}


def shard_path(directory: str | Path, tp_rank: int) -> Path:
    return Path(directory) / f"slot_rank{tp_rank}.pt"


def experts_path(directory: str | Path, ep: tuple[int, int]) -> Path:
    """The file of expert-parallel rank ``ep[0]`` of ``ep[1]``: its experts' tensors and moments."""
    return Path(directory) / f"experts_ep{ep[0]}of{ep[1]}.pt"


def expert_tensor_names(model: torch.nn.Module) -> frozenset[str]:
    """The slot tensors (and optimizer entries) split over expert-parallel ranks: every expert
    layer's ``lora_B`` and its per-expert ``lora_A`` (a shared ``A`` is whole on each rank)."""
    names = set()
    for layer in multi_lora_layers(model):
        if isinstance(layer, MultiLoRAExpertLinear):
            names.add(f"{layer.key}.lora_B")
            if not layer.shared_a:
                names.add(f"{layer.key}.lora_A")
    return frozenset(names)


def _split(state: dict, names: frozenset[str], keep: bool) -> dict:
    """``state`` (``{"slot", "optimizer"}``) with only the tensors in ``names`` (``keep``) or without them."""
    out = dict(state, slot={n: t for n, t in state["slot"].items() if (n in names) == keep})
    out["optimizer"] = {
        k: ({n: t for n, t in v.items() if (n in names) == keep} if k in MOMENTS else v)
        for k, v in state["optimizer"].items()
    }
    return out


def _save(path: Path, state: dict) -> Path:
    tmp = path.with_name(f".{path.name}.part")
    with private_open(tmp, "wb") as f:  # 0600, its directories 0700
        torch.save(state, f)
    os.replace(tmp, path)
    return path


def write_shard(
    directory: str | Path,
    tp_rank: int,
    slot: dict[str, torch.Tensor],
    optimizer: dict,
    meta: SlotMeta,
    ep: tuple[int, int] = (0, 1),
    experts: frozenset[str] = frozenset(),
    parts: tuple[bool, bool] = (True, True),
) -> Path:
    """Write TP rank ``tp_rank``'s shard into ``directory`` (created), atomically. With expert
    parallelism (``ep``: this rank's EP rank and size) the tensors named in ``experts`` go to the
    EP rank's own file; ``parts``: whether this rank writes the TP shard, its experts' file."""
    state = {"slot": slot, "optimizer": optimizer, "meta": meta_dict(meta)}
    path = shard_path(directory, tp_rank)
    if ep[1] == 1:
        return _save(path, state)
    if parts[1]:
        _save(experts_path(directory, ep), _split(state, experts, keep=True))
    if parts[0]:
        _save(path, _split(state, experts, keep=False))
    return path


def meta_dict(meta: SlotMeta) -> dict[str, Any]:
    """``meta`` as plain values (``targets`` a list) for ``torch.save``."""
    out = asdict(meta)
    if meta.targets is not None:
        out["targets"] = list(meta.targets)
    return out


def saved_ep_size(directory: str | Path) -> int:
    """The expert-parallel size a state in ``directory`` was saved at (1: the experts are in the TP shards)."""
    found = sorted(Path(directory).glob("experts_ep0of*.pt"))
    return int(found[0].stem.rsplit("of", 1)[1]) if found else 1


def _tp_shard(directory: str | Path, tp_rank: int, tp: TPSplit | None) -> dict[str, Any]:
    """TP rank ``tp_rank``'s shard as saved, or (``tp`` given, saved at another TP size) re-split."""
    saved = saved_tp_size(directory) if tp is not None else 0
    if tp is None or saved in (0, tp.size):  # 0: no shard, the read below names the missing file
        return torch.load(shard_path(directory, tp_rank), weights_only=True)
    shards = [torch.load(shard_path(directory, r), weights_only=True) for r in range(saved)]
    return resplit(shards, tp, tp_rank)


def read_shard(
    directory: str | Path,
    tp_rank: int,
    ep: tuple[int, int] = (0, 1),
    experts: frozenset[str] = frozenset(),
    tp: TPSplit | None = None,
) -> dict[str, Any]:
    """TP rank ``tp_rank``'s shard: ``{"slot", "optimizer"}`` and ``"meta"`` (a dict) when written;
    with ``tp`` (the model's TP split) from a state saved at any TP size. For EP rank ``ep[0]`` of
    ``ep[1]``, its local experts (the tensors named in ``experts``, split on their first dimension)
    from the state saved at any EP size."""
    base = _tp_shard(directory, tp_rank, tp)
    saved = saved_ep_size(directory)
    if saved == 1 and ep[1] == 1:
        return base
    files = [base] if saved == 1 else []
    for j in range(saved if saved > 1 else 0):  # every saved EP rank's experts
        files.append(torch.load(experts_path(directory, (j, saved)), weights_only=True))
    if saved > 1:  # what the saved experts' files hold
        experts = experts | frozenset(files[0]["slot"])
    name = next((n for n in sorted(experts) if n in files[0]["slot"]), None)
    if name is None:
        return base
    per_saved = files[0]["slot"][name].shape[0]
    total = per_saved * len(files)
    if total % ep[1]:
        raise SpecError("model.ep", f"the saved state's {total} experts do not split over {ep[1]} EP ranks")
    lo, hi = ep[0] * total // ep[1], (ep[0] + 1) * total // ep[1]

    def join(tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {n: torch.cat([p[n] for p in tensors])[lo:hi] for n in tensors[0] if n in experts}

    out = dict(base, slot={**base["slot"], **join([f["slot"] for f in files])})
    optimizer = dict(base["optimizer"])
    for key in MOMENTS:
        if key in optimizer:
            optimizer[key] = {**optimizer[key], **join([f["optimizer"][key] for f in files])}
    out["optimizer"] = optimizer
    return out


def shard_meta(shard: dict[str, Any]) -> SlotMeta | None:
    """The :class:`SlotMeta` of a read shard (None for a shard written before it existed)."""
    meta = shard.get("meta")
    if meta is None:
        return None
    targets = meta.get("targets")
    return SlotMeta(
        str(meta["name"]), int(meta["rank"]), float(meta["alpha"]), int(meta["seed"]), int(meta["version"]),
        None if targets is None else tuple(str(t) for t in targets),
    )  # fmt: skip
