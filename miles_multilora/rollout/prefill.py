"""Bringing admitted work into the decode batch: padded prefill forwards, then each row's state.

Two kinds of work come in. A new :class:`~.rows.Group` prefills its prompt once into its full pages
(shared by its members, each of which copies the partial last page) and samples each member's
first token from the prompt's logits. A resumed :class:`~.rows.Row` (one that was preempted)
prefills its prompt and the outputs it had fed to the model into pages of its own, and takes back
its outputs, count and stop-string progress, so its next decode step is the one it would have
run: same input token, position, output index (the sampling noise's counter) and budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles_multilora.host_tensors import to_device
from miles_multilora.lora.inject import model_num_slots, token_slots
from miles_multilora.lora.routing import row_routing_plan
from miles_multilora.rollout.decode_batch import DecodeBatch
from miles_multilora.rollout.device_sampling import sample_tokens
from miles_multilora.rollout.kv_cache import PagedKVCache
from miles_multilora.rollout.rows import Group, Row, pages_for
from miles_multilora.rollout.types import GenerationRequest

if TYPE_CHECKING:
    from miles_multilora.rollout.embedded import EmbeddedEngine

PREFILL_TOKENS = 16384  # padded tokens per prefill forward


def filters(req: GenerationRequest) -> bool:
    """Whether ``req`` samples from a top-k / top-p filtered distribution (greedy rows do not)."""
    sp = req.sampling
    return sp.temperature > 0 and (sp.top_k > 1 or sp.top_p < 1.0)


@dataclass
class _Sequence:
    """One sequence of a prefill forward: a group's prompt, or a resumed row's prompt + outputs."""

    slot: int
    tokens: list[int]
    pages: list[int]  # where its K/V go
    group: Group | None = None
    resumed: Row | None = None


class RowStarter:
    """Prefills admitted groups and resumed rows and loads their rows into the batch."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        batch: DecodeBatch,
        cache: PagedKVCache,
        requests: Sequence[GenerationRequest],
        admission_order: Iterator[int],
    ) -> None:
        self.engine, self.batch, self.cache, self.requests = engine, batch, cache, requests
        self.admission_order = admission_order

    def start(self, groups: list[Group], resumed: list[Row], first: int) -> list[Row]:
        """Prefill ``groups`` and ``resumed`` rows (similar lengths together, at most
        ``PREFILL_TOKENS`` padded tokens per forward; on a CPU one sequence per forward, so that a
        prompt's logits never depend on what else is admitted with it: CPU GEMMs round by their
        shape) and load their rows into batch rows ``first, first + 1, ...``; returns those rows in
        batch order."""
        return self.run_chunks(self.chunks(groups, resumed), first)

    def chunks(self, groups: list[Group], resumed: list[Row]) -> list[list[_Sequence]]:
        """The prefill forwards :meth:`start` runs for ``groups`` and ``resumed``, one list each."""
        work = [_Sequence(g.slot, g.prompt, [], group=g) for g in groups]
        work += [
            _Sequence(self.requests[r.request].slot, self._resume_tokens(r), [], resumed=r) for r in resumed
        ]
        out: list[list[_Sequence]] = []
        chunk: list[_Sequence] = []
        for item in sorted(work, key=lambda s: len(s.tokens)):  # similar lengths pad less
            longest = max(len(item.tokens), *(len(s.tokens) for s in chunk)) if chunk else len(item.tokens)
            if chunk and (longest * (len(chunk) + 1) > PREFILL_TOKENS or self.engine.device.type == "cpu"):
                out.append(chunk)
                chunk = []
            chunk.append(item)
        if chunk:
            out.append(chunk)
        return out

    def run_chunks(self, chunks: list[list[_Sequence]], first: int) -> list[Row]:
        """Prefill ``chunks`` (from :meth:`chunks`); their rows loaded at ``first, first + 1, ...``."""
        rows: list[Row] = []
        for chunk in chunks:
            rows += self._prefill(chunk, first + len(rows))
        return rows

    def idle_prefill(self) -> None:
        """A prefill forward of one padding token, base only, into the null page, its logits unused:
        an expert-parallel rank with less to prefill joins the other ranks' token exchange."""
        self._forward([_Sequence(-1, [self.engine.pad_id], [0])])

    def _resume_tokens(self, row: Row) -> list[int]:
        return row.resume_tokens(list(self.requests[row.request].prompt_ids))

    # ------------------------------------------------------------------ prefill
    def _prefill(self, chunk: list[_Sequence], first: int) -> list[Row]:
        """One padded prefill forward for ``chunk``; its rows loaded at ``first, first + 1, ...``."""
        engine, cache = self.engine, self.cache
        new_rows: list[Row] = []
        member_seq: list[int] = []  # each new row's sequence in the chunk
        copies_src: list[int] = []
        copies_dst: list[int] = []
        for s_index, seq in enumerate(chunk):
            if seq.resumed is not None:
                seq.resumed.pages = seq.pages = cache.alloc(pages_for(len(seq.tokens), cache.page_size))
                engine.stats["resumed_tokens"] += len(seq.tokens)
                continue
            group = seq.group
            assert group is not None
            members = self._new_rows(group)
            full = len(group.prompt) // cache.page_size
            for k, row in enumerate(members):
                if k > 0 and len(row.pages) > full:  # the first member's partial page, copied after
                    copies_src.append(members[0].pages[full])
                    copies_dst.append(row.pages[full])
            seq.pages = members[0].pages
            new_rows += members
            member_seq += [s_index] * len(members)
        logits = self._forward(chunk)
        engine.stats["prefill_forwards"] += 1
        engine.stats["prefilled_prompts"] += sum(seq.group is not None for seq in chunk)
        cache.copy_pages(copies_src, copies_dst)
        resumed = [seq.resumed for seq in chunk if seq.resumed is not None]
        if new_rows:
            index = torch.tensor(member_seq, device=engine.device)
            self._load_new(new_rows, logits[index], first)
        self._load_resumed(resumed, first + len(new_rows))
        return new_rows + resumed

    def _new_rows(self, group: Group) -> list[Row]:
        """A row per member: the prompt's full pages (shared) and its own copy of the partial page."""
        engine, cache = self.engine, self.cache
        plen, page = len(group.prompt), cache.page_size
        shared = cache.alloc(plen // page)
        rows = []
        for k, i in enumerate(group.members):
            req = self.requests[i]
            if k > 0:
                cache.share(shared)
            own = cache.alloc(1 if plen % page else 0)
            rows.append(
                Row(
                    request=i,
                    pages=shared + own,
                    prompt_len=plen,
                    budget=engine.budget(req),
                    stops=list(req.sampling.stop),
                    stop_ids=frozenset(req.sampling.stop_token_ids),
                    filtered=filters(req),
                    admitted=next(self.admission_order),
                    versions=[(0, engine.current_version(req))],
                )
            )
        return rows

    def _forward(self, chunk: list[_Sequence]) -> Tensor:
        """The padded prefill forward: K/V into each sequence's pages, its last logits ``[B, V]``."""
        engine, device = self.engine, self.engine.device
        seq = max(len(s.tokens) for s in chunk)
        ep = engine.expert_parallel
        if ep is not None and ep.equal_tokens:  # as many rows and tokens as on the other EP ranks
            rows, seq = ep.agree([len(chunk), seq])
            chunk = chunk + [_Sequence(-1, [engine.pad_id], [0])] * (rows - len(chunk))
        tokens = torch.full((len(chunk), seq), engine.pad_id, dtype=torch.long)
        for b, s in enumerate(chunk):
            tokens[b, : len(s.tokens)] = torch.tensor(s.tokens)
        lengths = torch.tensor([len(s.tokens) for s in chunk])
        table = torch.zeros(len(chunk), max(len(s.pages) for s in chunk), dtype=torch.int32)
        for b, s in enumerate(chunk):
            table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
        # host data, copied without a host wait; the routing plan from the host's slot list
        tokens, lengths, table = (
            to_device(tokens, device),
            to_device(lengths, device),
            to_device(table, device),
        )
        if engine.layers:
            plan = row_routing_plan([s.slot for s in chunk], seq, model_num_slots(engine.model), device)
            with token_slots(engine.model, plan):
                return engine.paged.prefill(self.cache, tokens, lengths, table)
        return engine.paged.prefill(self.cache, tokens, lengths, table)

    # ------------------------------------------------------------------ loading rows
    def _load_common(self, rows: list[Row], first: int, positions: list[int]) -> slice:
        """Rows ``first ..``: position, block table, slot, sampling parameters and budget."""
        batch, device = self.batch, self.engine.device
        idx = slice(first, first + len(rows))
        reqs = [self.requests[r.request] for r in rows]
        table = torch.zeros(len(rows), batch.block_table.shape[1], dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        batch.positions[idx] = torch.tensor(positions, device=device)
        batch.block_table[idx] = table.to(device)
        batch.slots[idx] = torch.tensor([q.slot for q in reqs], device=device)
        batch.temperature[idx] = torch.tensor(
            [q.sampling.temperature for q in reqs], dtype=torch.float32, device=device
        )
        batch.top_k[idx] = torch.tensor([q.sampling.top_k for q in reqs], device=device)
        batch.top_p[idx] = torch.tensor([q.sampling.top_p for q in reqs], dtype=torch.float32, device=device)
        batch.seeds[idx] = torch.tensor([q.seed & 0xFFFF_FFFF for q in reqs], device=device)
        batch.budget[idx] = torch.tensor([r.budget for r in rows], device=device)
        return idx

    def _load_new(self, rows: list[Row], logits: Tensor, first: int) -> None:
        """Sample each new row's first token from its prompt's logits and load its state."""
        batch, engine = self.batch, self.engine
        idx = self._load_common(rows, first, [r.prompt_len for r in rows])
        reqs = [self.requests[r.request] for r in rows]
        token, logprob = sample_tokens(
            logits,
            engine.vocab_size,
            batch.temperature[idx],
            batch.seeds[idx],
            torch.zeros(len(rows), dtype=torch.long, device=engine.device),
            batch.top_k[idx],
            batch.top_p[idx],
            filtered=any(filters(q) for q in reqs),
        )
        batch.tokens[idx] = token
        batch.count[idx] = 1
        batch.out_tokens[idx, 0] = token
        batch.out_logprobs[idx, 0] = logprob
        batch.active[idx] = ~(
            (token.unsqueeze(1) == batch.eos.unsqueeze(0)).any(1) | (batch.budget[idx] <= 1)
        )

    def _load_resumed(self, rows: list[Row], first: int) -> None:
        """Give preempted rows back their outputs and counters: the next decode step feeds their
        last output at its position and samples output ``count``."""
        if not rows:
            return
        batch, device = self.batch, self.engine.device
        idx = self._load_common(rows, first, [r.prompt_len + r.count - 1 for r in rows])
        width = max(r.count for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, r in enumerate(rows):
            tokens[i, : r.count] = torch.tensor(r.saved_tokens)
            logprobs[i, : r.count] = torch.tensor(r.saved_logprobs)
        batch.out_tokens[idx, :width] = tokens.to(device)
        batch.out_logprobs[idx, :width] = logprobs.to(device)
        batch.tokens[idx] = torch.tensor([r.saved_tokens[-1] for r in rows], device=device)
        batch.count[idx] = torch.tensor([r.count for r in rows], device=device)
        batch.active[idx] = True
        for r in rows:
            r.saved_tokens, r.saved_logprobs = [], []
