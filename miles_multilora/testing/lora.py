"""MultiLoRA helpers for tests and benchmarks: tiny Megatron setup, random slots, PEFT references, the
Triton interpreter patch."""

from __future__ import annotations

import torch

from miles_multilora.lora.layer import MultiLoRALinear


def patch_triton_interpreter() -> None:
    """Make Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) work with NumPy >= 2.4.

    The interpreter turns loop bounds into ints with ``int(ndarray)``, which NumPy 2.4 refuses for
    1-element 1-d arrays; this converts through ``.item()`` instead. Interpreter only, idempotent.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_miles_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._miles_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def megatron_tp1() -> None:
    """Single-process Megatron (TP=1, PP=1) on CPU."""
    from miles_multilora.models import compat

    compat.init_distributed(tp=1, pp=1, seed=0)


def tiny_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
        add_bias_linear=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def randomize_slots(layer: MultiLoRALinear, ranks: list[int], alphas: list[float], seed: int = 0) -> None:
    """Random non-zero A and B for each slot, zero beyond its rank (ranks[s] == 0: empty slot)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_A.zero_()
        layer.lora_B.zero_()
        for s, (r, alpha) in enumerate(zip(ranks, alphas, strict=True)):
            if r:
                layer.lora_A[s, :r] = torch.randn(r, layer.in_features, generator=gen)
                layer.lora_B[s, :, :r] = torch.randn(layer.out_features, r, generator=gen)
            layer.set_slot_scale(s, r, alpha / r if r else 0.0)


def peft_reference(layer: MultiLoRALinear, base_fn, x: torch.Tensor, slot_ids: torch.Tensor, ranks, alphas):
    """Independent single-LoRA references: y = base(x) + (alpha/r) * B_r A_r x per token.

    ``x`` is [S, B, in] and ``slot_ids`` [B, S]. Returns (y, x_leaf, {slot: (A_r, B_r)}).
    """
    x_ref = x.detach().clone().requires_grad_(True)
    params = {
        s: (
            layer.lora_A[s, :r].detach().clone().requires_grad_(True),
            layer.lora_B[s, :, :r].detach().clone().requires_grad_(True),
        )
        for s, r in enumerate(ranks)
        if r
    }
    y = base_fn(x_ref)
    rows = []
    S, B = slot_ids.shape[1], slot_ids.shape[0]
    for si in range(S):
        row = []
        for bi in range(B):
            s = int(slot_ids[bi, si])
            tok = x_ref[si, bi]
            if s >= 0 and ranks[s]:
                a, b = params[s]
                row.append((alphas[s] / ranks[s]) * (b @ (a @ tok)))
            else:
                row.append(torch.zeros(y.shape[-1]))
        rows.append(torch.stack(row))
    return y + torch.stack(rows), x_ref, params


TINY_GPT_SIZES = dict(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    max_seq_len=32,
)  # the tests' tiny GPT (tests/moe_helpers.py adds experts)


def tiny_gpt_with_lora(
    num_slots: int,
    max_rank: int,
    seed: int = 0,
    tp: int = 1,
    rank: int | None = None,
    kernels: str = "auto",
    target_modules: str | list[str] = "all-linear",
    **sizes,
):
    """A tiny CPU GPTModel (the provider's) with MultiLoRA on ``target_modules``. With ``rank`` set,
    this process is that rank of a ``tp``-process group (CPU init draws each full weight, then
    shards it, so every TP size builds the same model)."""
    from miles_multilora.lora.inject import apply_multi_lora
    from miles_multilora.models import compat
    from miles_multilora.models.provider import build_tiny_gpt

    compat.init_distributed(tp=tp, pp=1, seed=0, rank=rank, world_size=None if rank is None else tp)
    model = build_tiny_gpt(seed=seed, **{**TINY_GPT_SIZES, **sizes})
    apply_multi_lora(model, target_modules, num_slots=num_slots, max_rank=max_rank, kernels=kernels)
    return model


def lm_logits(model, input_ids: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of a GPTModel with tokens routed by ``slot_ids`` [B, S]."""
    from miles_multilora.lora.inject import token_slots

    device = next(model.parameters()).device
    input_ids, slot_ids = input_ids.to(device), slot_ids.to(device)
    pos = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    with token_slots(model, slot_ids):
        return model(input_ids, pos, None)


def per_row_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean per row: [B]."""
    lp = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        input_ids[:, 1:].reshape(-1).to(logits.device),
        reduction="none",
    )
    return lp.view(input_ids.shape[0], -1).mean(1)


def mixed_train_step(model, opt, batches: dict[int, torch.Tensor]):
    """One optimizer step on a batch mixing adapters: ``batches`` maps a slot to its rows of token
    ids ``[rows, seq]``; each adapter's loss is the mean over its rows, and the losses are summed.
    Returns what ``opt.step`` returns."""
    ids = torch.cat(list(batches.values()))
    slots = torch.cat([torch.full(tuple(b.shape), s) for s, b in batches.items()])
    row_loss = per_row_lm_loss(lm_logits(model, ids, slots), ids)
    loss, start = 0.0, 0
    for b in batches.values():
        loss = loss + row_loss[start : start + b.shape[0]].mean()
        start += b.shape[0]
    opt.zero_grad()
    loss.backward()
    return opt.step(batches.keys())
