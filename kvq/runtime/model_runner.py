"""Host-side batch preparation and the model call: sequences -> `ForwardBatch` -> fp32 logits.

Imports torch and kvq.runtime.
"""

from __future__ import annotations

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels import plan_paged_decode
from kvq.runtime.models.llama import LlamaForCausalLM
from kvq.runtime.sequence import Sequence


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, page_size: int, zero_page: int, num_kv_heads: int, device: torch.device
    ) -> None:
        self.model, self.page_size, self.zero_page, self.device = model, page_size, zero_page, device
        self.num_kv_heads = num_kv_heads  # of the KV pool's layout: one for the MLA latent

    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> ForwardBatch:
        """Prefill: every token after the cached prefix; decode: the last token of each sequence."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq in seqs:
            start = seq.num_cached_tokens if is_prefill else seq.num_tokens - 1
            input_ids += seq.token_ids[start:]
            positions += range(start, seq.num_tokens)
            slots += [
                seq.block_table[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(start, seq.num_tokens)
            ]
            query_lens.append(seq.num_tokens - start)
        max_pages = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (max_pages - len(seq.block_table)) for seq in seqs]
        context_lens = [seq.num_tokens for seq in seqs]
        max_context_len = max(context_lens)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        block_tables_t = tensor(block_tables, torch.int32)
        context_lens_t = tensor(context_lens, torch.int32)
        decode_plan = None
        if not is_prefill:
            decode_plan = plan_paged_decode(
                block_tables_t,
                context_lens_t,
                self.page_size,
                self.num_kv_heads,
                max_context_len,
                pad_slot=self.zero_page * self.page_size,
                has_empty=min(context_lens) == 0,
            )
        return ForwardBatch(
            is_prefill=is_prefill,
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_tables=block_tables_t,
            context_lens=context_lens_t,
            context_lens_list=context_lens,
            max_context_len=max_context_len,
            query_lens=query_lens,
            logits_indices=(torch.tensor(query_lens).cumsum(0) - 1).to(self.device),
            prompt_lens=[seq.num_prompt_tokens for seq in seqs],
            decode_plan=decode_plan,
        )

    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """fp32 logits `[B, V]` of each sequence's next token."""
        return self.forward(self.prepare(seqs, is_prefill))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits `[B, V]` of a prepared batch. With --kv-integrity on, `Engine` checks this very batch
        (its block tables and slot mapping, as the kernels will use them) between `prepare` and here."""
        hidden = self.model.forward(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.logits_indices])
