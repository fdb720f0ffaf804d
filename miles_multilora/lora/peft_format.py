"""The PEFT adapter format: module names, the ``adapter_config.json`` form of a slot's shape, and what
PEFT can save that a resident ``B @ A`` slot cannot hold (refused by name, with what to do).

Pure format logic, no model: :mod:`miles_multilora.lora.slots` turns slots into these tensors and
names and back.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_safetensors

from miles_multilora.errors import SpecError
from miles_multilora.lora import layout
from miles_multilora.private_files import private_open

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def hf_model_name(hf_config: Any) -> str | None:
    if hf_config is None:
        return None
    if isinstance(hf_config, dict):
        return hf_config.get("_name_or_path")
    return getattr(hf_config, "_name_or_path", None)


def leaf_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _hf_layer(name: str) -> int | None:
    match = _HF_LAYER.search(name)
    return None if match is None else int(match.group(1))


def _module_key(name: str) -> str:
    """A pattern key for one module: its name from ``layers.`` on (PEFT's old and current rules match it)."""
    match = _HF_LAYER.search(name)
    return name if match is None else name[match.start() :].lstrip(".")


def _pattern(values: dict[str, Any], default: Any) -> dict[str, Any]:
    """PEFT ``rank_pattern``/``alpha_pattern`` for modules whose value is not ``default``: one key per
    module name leaf when every module of that leaf agrees, else one key per module."""
    by_leaf: dict[str, dict[str, Any]] = defaultdict(dict)
    for name, value in values.items():
        by_leaf[leaf_name(name)][name] = value
    out: dict[str, Any] = {}
    for leaf, group in sorted(by_leaf.items()):
        distinct = set(group.values())
        if distinct == {default}:
            continue
        if len(distinct) == 1:
            out[leaf] = distinct.pop()
        else:
            out.update({_module_key(name): v for name, v in sorted(group.items()) if v != default})
    return out


def _targets(names: list[str], all_names: list[str]) -> dict[str, Any]:
    """The smallest PEFT targeting that selects exactly ``names`` among the model's ``all_names``."""
    leaves = sorted({leaf_name(n) for n in names})
    same_leaf = [n for n in all_names if leaf_name(n) in leaves]
    if set(names) == set(same_leaf):
        return {"target_modules": leaves}
    indices = {_hf_layer(n) for n in names}
    if None not in indices and set(names) == {n for n in same_leaf if _hf_layer(n) in indices}:
        return {"target_modules": leaves, "layers_to_transform": sorted(indices), "layers_pattern": "layers"}
    return {"target_modules": sorted(names)}


def peft_form(modules: dict[str, tuple[int, float]], all_names: list[str], rslora: bool) -> dict[str, Any]:
    """``LoraConfig`` fields that express ``{module: (rank, alpha)}`` exactly (most common rank/alpha
    as ``r``/``lora_alpha``, the others as patterns)."""
    ranks = Counter(r for r, _ in modules.values())
    alphas = Counter(a for _, a in modules.values())
    r = max(ranks, key=lambda k: (ranks[k], k))
    alpha = max(alphas, key=lambda k: (alphas[k], k))
    return {
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "rank_pattern": _pattern({n: m[0] for n, m in modules.items()}, r),
        "alpha_pattern": _pattern({n: m[1] for n, m in modules.items()}, alpha),
        **_targets(sorted(modules), all_names),
    }


def write_adapter(out_dir: Path, tensors: dict, form: dict[str, Any], base: str | None) -> None:
    from peft import LoraConfig

    config = LoraConfig(
        **form, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base
    )
    tmp_weights = out_dir / f".{ADAPTER_WEIGHTS}.tmp"
    with private_open(tmp_weights, "wb") as f:  # 0600, out_dir 0700 when created here
        f.write(save_safetensors(tensors, metadata={"format": "pt"}))
    tmp_config = out_dir / f".{ADAPTER_CONFIG}.tmp"
    data = config.to_dict()
    data = {k: (sorted(v) if isinstance(v, set) else v) for k, v in data.items()}
    with private_open(tmp_config, "w") as f:
        f.write(json.dumps(data, indent=2, default=str))
    os.replace(tmp_weights, out_dir / ADAPTER_WEIGHTS)
    os.replace(tmp_config, out_dir / ADAPTER_CONFIG)


_RETRAIN = "re-train the adapter without it, or merge it into the base model"
# adapter_config.json keys of PEFT features a resident B @ A slot cannot represent: (key, feature, what to do)
_UNSUPPORTED_CONFIG = (
    ("use_dora", "DoRA (use_dora=true)", _RETRAIN),
    ("lora_bias", "LoRA bias (lora_bias=true)", _RETRAIN),
    ("fan_in_fan_out", "fan_in_fan_out=true (Conv1D-style transposed weights)", "use a Linear-layer model"),
    ("modules_to_save", "modules_to_save (fully trained modules saved with the adapter)", _RETRAIN),
    ("trainable_token_indices", "trainable tokens (trainable_token_indices)", _RETRAIN),
    ("target_parameters", "LoRA on parameters (target_parameters)", _RETRAIN),
    ("layer_replication", "layer_replication", "re-train the adapter without it"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)", "re-train as a plain LoRA"),
    ("use_qalora", "QA-LoRA (use_qalora=true)", _RETRAIN),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)", _RETRAIN),
    (
        "velora_config",
        "VeLoRA (velora_config)",
        "its forward is plain LoRA: drop velora_config and the lora_velora_* tensors from the adapter",
    ),
    ("monteclora_config", "MonteCLoRA (monteclora_config)", _RETRAIN),
    ("arrow_config", "Arrow routing (arrow_config)", "load one expert adapter at a time"),
    ("kasa_config", "KaSA (kasa_config)", _RETRAIN),
)
# init_lora_weights values that change the base weights: the adapter only fits the changed base
_BASE_CHANGING_INIT = ("pissa", "corda", "olora", "loftq", "lora_ga")
# weight-name markers of the same features, for adapters whose config does not say (marker, feature)
_UNSUPPORTED_TENSORS = (
    ("lora_magnitude_vector", "DoRA (lora_magnitude_vector)"),
    ("lora_embedding_", "embedding LoRA (lora_embedding_A/B)"),
    (".lora_A.bias", "LoRA bias (lora_bias=true)"),
    (".lora_B.bias", "LoRA bias (lora_bias=true)"),
    ("modules_to_save", "modules_to_save (fully trained modules saved with the adapter)"),
    ("trainable_tokens", "trainable tokens (trainable_token_indices)"),
    ("lora_velora", "VeLoRA (velora_config)"),
    ("lora_diag", "KaSA (kasa_config)"),
)


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise SpecError(
            str(adapter_dir), f"not a PEFT adapter dir: needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise SpecError("peft_type", f"only LORA adapters can be loaded, got {cfg.get('peft_type')!r}")
    for key, feature, fix in _UNSUPPORTED_CONFIG:
        if cfg.get(key):
            raise SpecError(key, f"{feature} adapters are not supported: {fix}")
    if cfg.get("bias", "none") != "none":
        raise SpecError(
            "bias",
            f"bias={cfg['bias']!r} adapters train the base model's biases, which is not supported: "
            "re-train with bias='none', or merge it into the base model",
        )
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INIT):
        raise SpecError(
            "init_lora_weights",
            f"{init!r} adapters need the base weights PEFT changed at init, which is not supported: save "
            "it as a plain LoRA (PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))",
        )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise SpecError(
            "r", f"adapter_config.json needs r >= 1 and lora_alpha > 0, got r={r!r}, lora_alpha={alpha!r}"
        )
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict) or any(not isinstance(v, kind) or v <= 0 for v in pattern.values()):
            raise SpecError(key, f"needs a mapping of module patterns to numbers > 0, got {pattern!r}")
    return cfg


def _match(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key that matches the module name's end."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        except re.error as exc:
            raise SpecError(key, f"not a valid module pattern: {exc}") from exc
    return default


def module_rank_alpha(cfg: dict[str, Any], name: str) -> tuple[int, float]:
    """The module's rank and alpha as PEFT derives them from ``adapter_config.json``."""
    rank = _match(cfg.get("rank_pattern") or {}, name, cfg["r"])
    return int(rank), float(_match(cfg.get("alpha_pattern") or {}, name, cfg["lora_alpha"]))


def parse_weight_key(key: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (``X``, ``A``); names the PEFT feature of other tensors."""
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if key.startswith(layout.HF_PREFIX) and key.endswith(suffix):
            return key[len(layout.HF_PREFIX) : -len(suffix)], which
    for marker, feature in _UNSUPPORTED_TENSORS:
        if marker in key:
            raise SpecError(key, f"{feature} is not supported: {_RETRAIN}")
    if re.search(r"\.lora_(?![AB]\.)", key):
        raise SpecError(
            key, f"a LoRA variant tensor (only lora_A/lora_B weights) is not supported: {_RETRAIN}"
        )
    if key.startswith(layout.HF_PREFIX) and ".lora_" not in key and key.endswith((".weight", ".bias")):
        raise SpecError(
            key,
            "a base-model tensor saved with the adapter (modules_to_save, trained biases or full weights) "
            f"is not supported: {_RETRAIN}",
        )
    raise SpecError(key, f"not a PEFT LoRA weight name ({layout.HF_PREFIX}<module>.lora_A/B.weight)")
