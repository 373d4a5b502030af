"""The checked KV pool's state and its once-per-step check (`--kv-integrity tags` or `full`).

The block manager calls the `on_*` hooks at every take, attach, seal, free and unhash (and at a release
of a page that was already free: a double free, which it then ignores). They stamp the page's tag in a
host mirror of the tag table (flushed to the device table `page_tags [num_pages]` int64 once per step,
before the check) and append or update the request's expected tags (kept here by request id), which
come only from the request's own tokens and allocations, never from the shared table. `check(seqs, batch)`
then gathers and compares in one batch, before the model reads any page: every page the step's block
tables name, and the page every new token's K/V goes to (the slot mapping), against the writer's
expectation. In `full` mode it also re-hashes sampled bytes of each sealed page in the step and compares
with the hash taken after the forward that wrote it (`after_forward`). Imports torch and kvq.runtime.
"""

from __future__ import annotations

import logging

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.integrity.mismatch import PageMismatch
from kvq.runtime.integrity.page_sample import PageSample
from kvq.runtime.integrity.tags import FREE_TAG, fill_tag, sealed_tag
from kvq.runtime.kernels.integrity_check import check_page_tags, sampled_page_hash
from kvq.runtime.sequence import Sequence

NO_BYTE_HASH = -1  # not hashed (yet): the sampled-bytes hash itself is never negative
logger = logging.getLogger("kvq.integrity")


class TagTracker:
    """Page tags (and, with `sample`, sampled-bytes hashes of sealed pages) for one KV pool."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device,
        pool_bytes: torch.Tensor | None = None,
        sample: PageSample | None = None,
    ) -> None:
        self.num_pages, self.page_size, self.device = num_pages, page_size, device
        self.host_tags = torch.zeros(num_pages, dtype=torch.int64)  # [P]: every page free
        self._host = self.host_tags.numpy()  # scalar writes without a torch dispatch
        is_cpu = device.type == "cpu"
        self.page_tags = (
            self.host_tags if is_cpu else torch.zeros(num_pages, dtype=torch.int64, device=device)
        )
        self._is_dirty = False
        self.generation = 0  # pages taken from the free list so far
        self.pool_bytes, self.sample = pool_bytes, sample  # pool_bytes [L, C, P + 1, R] uint8
        self.is_full = sample is not None
        self.byte_hashes = torch.full((num_pages,), NO_BYTE_HASH, dtype=torch.int64, device=device)
        self._voided: list[int] = []  # pages taken since their byte hash was recorded
        self._pending: dict[int, int] = {}  # page -> tag: sealed this step, hashed once the forward wrote it
        self.num_free_page_releases = 0  # double frees seen (see `on_release_of_free_page`)
        self._expected_tags: dict[int, list[int]] = {}  # request id -> the tag each logical page must carry

    # -- hooks (block manager) ------------------------------------------------------------------------
    def on_take(self, seq: Sequence, page_id: int) -> None:
        """`page_id` left the free list to become `seq`'s next logical page: a new fill tag for both."""
        self.generation += 1
        tag = fill_tag(seq.seq_id, len(seq.block_table), self.generation)
        self._host[page_id] = tag
        self._is_dirty = True
        self._expected_tags.setdefault(seq.seq_id, []).append(tag)
        if self.is_full:
            self._voided.append(page_id)

    def on_attach(self, seq: Sequence, page_hash: int) -> None:
        """`seq` shares a sealed page whose chain hash, computed from `seq`'s own tokens, is `page_hash`."""
        self._expected_tags.setdefault(seq.seq_id, []).append(sealed_tag(page_hash))

    def on_seal(self, seq: Sequence, index: int, page_id: int, page_hash: int) -> None:
        """`seq`'s logical page `index` is full: page and expectation both become the chain hash."""
        tag = sealed_tag(page_hash)
        self._host[page_id] = tag
        self._is_dirty = True
        self._expected_tags[seq.seq_id][index] = tag
        if self.is_full:
            self._pending[page_id] = tag

    def on_deallocate(self, seq: Sequence) -> None:
        """`seq` holds no pages any more (finished, stopped or preempted): its expectations go."""
        self._expected_tags.pop(seq.seq_id, None)

    def on_free(self, page_id: int, is_sealed: bool) -> None:
        """The last reference is gone. A sealed page keeps its tag (a prefix hit may revive it)."""
        if not is_sealed:
            self._host[page_id] = FREE_TAG
            self._is_dirty = True

    def on_release_of_free_page(self, page_id: int) -> None:
        """A reference was dropped from a page that had none left (a release ran twice). The block manager
        leaves the page free (listed once); the slip is logged and counted. A request still using the page
        is caught by its tag once the page is taken again."""
        self.num_free_page_releases += 1
        logger.warning("page %d was released while already free (a double free); it stays free", page_id)

    def on_unhash(self, page_id: int, ref_count: int) -> None:
        """The page left the prefix cache (content untrusted); free, it is no one's any more."""
        self._pending.pop(page_id, None)
        if ref_count == 0:
            self._host[page_id] = FREE_TAG
            self._is_dirty = True

    # -- the step check ---------------------------------------------------------------------------------
    def check(self, seqs: list[Sequence], batch: ForwardBatch) -> list[PageMismatch]:
        """Every failed page of this step (empty: all good). One gather-and-compare, one host sync."""
        self._flush()
        num_rows, width = batch.block_tables.shape
        expected = self._expected(seqs, batch, width)
        pages = batch.slot_mapping.div(self.page_size, rounding_mode="floor")  # [T]: where K/V goes
        page_ids = torch.cat([batch.block_tables.flatten().long(), pages])  # [B * M + T]
        expected_t = torch.tensor(expected, dtype=torch.int64).to(self.device, non_blocking=True)
        is_bad = check_page_tags(self.page_tags, page_ids, expected_t)
        any_bad = is_bad.any()
        if self.is_full:
            sealed = list(
                dict.fromkeys(p for s in seqs for p in s.block_table[: s.num_tokens // self.page_size])
            )
            sealed_t, found, recorded = self._rehash(sealed)
            is_changed = (recorded != NO_BYTE_HASH) & (found != recorded)
            any_bad = any_bad | is_changed.any()
        if not any_bad.item():
            return []
        mismatches = self._tag_mismatches(seqs, batch, page_ids, expected, is_bad)
        if self.is_full:
            changed = is_changed.nonzero().flatten().tolist()
            mismatches += self._byte_mismatches(seqs, sealed, changed, found.tolist(), recorded.tolist())
        return mismatches

    def after_forward(self) -> None:
        """Hash the pages sealed this step, now that the forward wrote their K/V (full mode)."""
        if not self._pending:
            return
        pages = [p for p, tag in self._pending.items() if self._host[p] == tag]  # still sealed as then
        self._pending.clear()
        if pages:
            pages_t = torch.tensor(pages, dtype=torch.int64).to(self.device)
            self.byte_hashes[pages_t] = self._hash(pages_t)

    def tag_of(self, page_id: int) -> int:
        return int(self._host[page_id])

    def expected_tags(self, seq: Sequence) -> list[int]:
        """The tag each of `seq`'s logical pages must carry, from its own tokens and allocations."""
        return self._expected_tags.get(seq.seq_id, [])

    # -- internals --------------------------------------------------------------------------------------
    def _flush(self) -> None:
        """The step's tag changes to the device table in one copy; taken pages' byte hashes voided."""
        if self._is_dirty and self.page_tags is not self.host_tags:
            self.page_tags.copy_(self.host_tags)
        self._is_dirty = False
        if self._voided:
            self.byte_hashes[torch.tensor(self._voided, dtype=torch.int64).to(self.device)] = NO_BYTE_HASH
            self._voided.clear()

    def _expected(self, seqs: list[Sequence], batch: ForwardBatch, width: int) -> list[int]:
        """Flat expectations `[B * width + T]`: each row's pages (0-padded), then each new token's page."""
        expected: list[int] = []
        rows = [self.expected_tags(seq) for seq in seqs]
        for tags in rows:
            expected += tags
            expected += [FREE_TAG] * (width - len(tags))
        size = self.page_size
        if not batch.is_prefill:  # one new token each, the last: the hot path, kept to one comprehension
            expected += [tags[(len(s.token_ids) - 1) // size] for s, tags in zip(seqs, rows, strict=True)]
            return expected
        for seq, tags, query_len in zip(seqs, rows, batch.query_lens, strict=True):
            expected += [tags[p // size] for p in range(seq.num_tokens - query_len, seq.num_tokens)]
        return expected

    def _hash(self, pages: torch.Tensor) -> torch.Tensor:
        assert self.pool_bytes is not None and self.sample is not None
        return sampled_page_hash(self.pool_bytes, pages, self.sample.offsets, self.sample.coeffs)

    def _rehash(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page ids, their sampled-bytes hash now, the hash recorded after their sealing forward)."""
        pages_t = torch.tensor(pages, dtype=torch.int64).to(self.device)
        return pages_t, self._hash(pages_t), self.byte_hashes[pages_t]

    def _tag_mismatches(
        self,
        seqs: list[Sequence],
        batch: ForwardBatch,
        page_ids: torch.Tensor,
        expected: list[int],
        is_bad: torch.Tensor,
    ) -> list[PageMismatch]:
        width = batch.block_tables.shape[1]
        num_read = len(seqs) * width
        pages, positions = page_ids.tolist(), batch.positions.tolist()
        owners = [b for b, query_len in enumerate(batch.query_lens) for _ in range(query_len)]
        out = []
        for k in is_bad.nonzero().flatten().tolist():
            page = pages[k]
            found = int(self._host[page]) if 0 <= page < self.num_pages else None
            if k < num_read:
                row, index = divmod(k, width)
                out.append(PageMismatch(seqs[row], "read", index, page, expected[k], found))
            else:
                t = k - num_read
                index = positions[t] // self.page_size
                mismatch = PageMismatch(
                    seqs[owners[t]], "write", index, page, expected[k], found, positions[t]
                )
                out.append(mismatch)
        return out

    def _byte_mismatches(
        self,
        seqs: list[Sequence],
        sealed: list[int],
        changed: list[int],
        found: list[int],
        recorded: list[int],
    ) -> list[PageMismatch]:
        """One mismatch per request holding each changed page (every holder would read it)."""
        out = []
        for n in changed:
            for seq in seqs:
                for index, page in enumerate(seq.block_table[: seq.num_tokens // self.page_size]):
                    if page == sealed[n]:
                        out.append(PageMismatch(seq, "bytes", index, page, recorded[n], found[n]))
        return out
