"""Which module families an adapter trains: its LoRA targets (``attn``, ``mlp``, ``unembed``).

A model wraps some linear layers (``lora.target_modules``); each wrapped layer belongs to one family:
``attn`` (``linear_qkv``, ``linear_proj``), ``mlp`` (``linear_fc1``, ``linear_fc2``; the experts' in
a mixture-of-experts layer) or ``unembed`` (``output_layer``). A slot trains a subset of the
families the model wraps. In a layer of a family it does not train, the slot is empty (rank 0,
scale 0, ``A = B = 0``), as in a layer a loaded PEFT adapter does not hold: its delta there is
exactly zero, so are its gradients, and AdamW (weight decay included) keeps zeros at zero. So the
mask costs nothing per token: the kernels' per-slot scale and zero ``B`` already do it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from miles_multilora.errors import SpecError

ATTN, MLP, UNEMBED = "attn", "mlp", "unembed"
FAMILIES = (ATTN, MLP, UNEMBED)
_FAMILY_OF_MODULE = {
    "linear_qkv": ATTN,
    "linear_proj": ATTN,
    "linear_fc1": MLP,
    "linear_fc2": MLP,
    "output_layer": UNEMBED,
}


def family_of(layer_key: str) -> str:
    """The family of a MultiLoRA layer by its key (``layers.3.linear_qkv`` -> ``attn``)."""
    leaf = layer_key.rsplit(".", 1)[-1]
    family = _FAMILY_OF_MODULE.get(leaf)
    if family is None:
        raise SpecError("lora_targets", f"layer {layer_key!r} belongs to no LoRA target family {FAMILIES}")
    return family


def families_of_modules(target_modules: Iterable[str]) -> tuple[str, ...]:
    """The families a model wraps, from its ``lora.target_modules`` (``all-linear``: attn and mlp)."""
    found = set()
    for module in target_modules:
        found |= {ATTN, MLP} if module == "all-linear" else {_FAMILY_OF_MODULE.get(module)}
    return tuple(f for f in FAMILIES if f in found)


def check_targets(
    targets: Sequence[str] | None, available: Sequence[str] = FAMILIES, key: str = "lora_targets"
) -> tuple[str, ...]:
    """``targets`` as a canonical tuple (``FAMILIES`` order); None: every family in ``available``.

    Raises :class:`SpecError` naming ``key`` for anything but a non-empty list of distinct families
    that the model wraps (``available``)."""
    if targets is None:
        return tuple(f for f in FAMILIES if f in available)
    if isinstance(targets, str) or not isinstance(targets, Sequence):
        raise SpecError(key, f"must be a list of {list(FAMILIES)}, got {targets!r}")
    unknown = [t for t in targets if t not in FAMILIES]
    if unknown:
        raise SpecError(key, f"unknown {unknown}: choose from {list(FAMILIES)}")
    if not targets:
        raise SpecError(key, f"an empty list trains nothing: name at least one of {list(available)}")
    if len(set(targets)) != len(targets):
        raise SpecError(key, f"lists a family twice: {list(targets)}")
    missing = [t for t in targets if t not in available]
    if missing:
        hint = "add output_layer to" if UNEMBED in missing else "widen"
        raise SpecError(
            key,
            f"{missing} not wrapped by this model: its LoRA layers cover {list(available)} "
            f"(lora.target_modules); drop {missing} or {hint} lora.target_modules",
        )
    return tuple(f for f in FAMILIES if f in targets)
