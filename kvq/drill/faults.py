"""Every fault of the drill (`kvq.drill.workload`), the lowest `--kv-integrity` mode meant to catch it,
and what must come of it: the requests it stops ("error", before the bad slot or page is read), the
requests aborted by the client as part of the fault, and whether the tracker repairs a slip instead
(a free of a page requests still hold is refused: nobody is stopped, nobody's page changes hands).
Everyone else's tokens and fp32 logits must equal a fault-free run's.

Timing (pages of `DRILL_PAGE_SIZE` = 4 tokens, injected before step 5, when b holds 17 tokens, c 15,
d 16, e 11): step 5 is wave 1's prefill, step 6 the first decode step after it (d's token fills and
seals d's logical page 3; b takes a page), step 7 wave 2's prefill. Imports kvq.drill and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvq.drill.fault_injector import FaultInjector
from kvq.runtime.batch import ForwardBatch
from kvq.runtime.request import Request

Ids = dict[str, int]
Inject = Callable[[FaultInjector, Ids], int | None]  # returns the page the failed check must name


@dataclass(frozen=True)
class Fault:
    name: str
    mode: str  # the lowest --kv-integrity mode that catches it ("off": no mode needs to)
    hit: tuple[str, ...]  # the requests it must stop (by workload name)
    inject: Inject
    aborted: tuple[str, ...] = ()  # requests the client aborts as part of the fault
    is_repaired: bool = False  # the tracker refuses the slip (counted in `num_repairs`)


def _table(injector: FaultInjector, ids: Ids, name: str) -> list[int]:
    return injector.running(ids[name]).block_table


# -- free-list and reference slips: the tracker's holders refuse the free ------------------------------
def _premature_free(injector: FaultInjector, ids: Ids) -> int:
    return injector.premature_free(ids["e"], 0)


def _premature_free_sealing(injector: FaultInjector, ids: Ids) -> int:
    """The page d's next token fills (sealed in step 6): freed, it would go to wave 1 first."""
    return injector.premature_free(ids["d"], 3)


def _double_free(injector: FaultInjector, ids: Ids) -> int:
    page = _table(injector, ids, "b")[0]  # a, which shared it, has finished: b holds the only reference
    injector.double_free(page)
    return page


# -- prefix-cache slips ----------------------------------------------------------------------------------
def _stale_prefix_hit(injector: FaultInjector, ids: Ids) -> int:
    page = _table(injector, ids, "c")[0]  # f's first page will be c's
    page_size = injector.block_manager.page_size
    injector.stale_prefix_hit(page, [700 + i for i in range(page_size)])
    return page


def _hash_collision(injector: FaultInjector, ids: Ids) -> None:
    injector.weaken_hash()  # k's second page looks like h's: the same tokens after another first page


# -- block-table slips -----------------------------------------------------------------------------------
def _off_by_one(injector: FaultInjector, ids: Ids) -> int:
    return injector.off_by_one(ids["d"], 2)


def _seal_wrong_entry(injector: FaultInjector, ids: Ids) -> int:
    """d's entry for the page it seals in step 6 names e's page being filled."""
    page = _table(injector, ids, "e")[2]
    injector.replace_entry(ids["d"], 3, page)
    return page


def _seal_swap(injector: FaultInjector, ids: Ids) -> int:
    """d's page being sealed and e's page being filled swapped in their tables."""
    page = _table(injector, ids, "e")[2]
    injector.swap_entries(ids["d"], 3, ids["e"], 2)
    return page


def _row_one_longer(injector: FaultInjector, ids: Ids) -> int:
    page = _table(injector, ids, "b")[-1]
    injector.append_entry(ids["e"], page)
    return page


def _prefix_unwritten(injector: FaultInjector, ids: Ids) -> None:
    """h's entry for the page it seals at admission (logical page 1, which i attaches in the same
    prefill and j later) names another page, so h's forward would never write its own page 1."""

    def slip(seq: Request) -> None:
        seq.block_table[1] = injector.running(ids["c"]).block_table[1]

    injector.after_next_allocate(ids["h"], slip)


# -- wrong batches ---------------------------------------------------------------------------------------
def _misdirected_write(injector: FaultInjector, ids: Ids) -> int:
    injector.misdirected_write(ids["e"], ids["c"], 0)
    return _table(injector, ids, "c")[0]


def _one_slot_back(batch: ForwardBatch, row: int, token: int, page_size: int) -> ForwardBatch:
    """The token's K/V one slot off inside its own page (back, or forward from a page's first slot)."""
    slot = int(batch.slot_mapping[token])
    batch.slot_mapping[token] = slot - 1 if slot % page_size else slot + 1
    return batch


def _slot_one_off(injector: FaultInjector, ids: Ids) -> int:
    size = injector.block_manager.page_size
    injector.change_next_batch(ids["e"], lambda b, row, t: _one_slot_back(b, row, t, size))
    return _table(injector, ids, "e")[2]


def _slot_one_off_prefill(injector: FaultInjector, ids: Ids) -> None:
    """In wave 1's prefill (h on c's first page), h's first new token one slot off in its own page."""
    size = injector.block_manager.page_size
    injector.change_next_prefill(ids["h"], lambda b, row, t: _one_slot_back(b, row, t, size))


def _position_one_off(injector: FaultInjector, ids: Ids) -> None:
    def change(batch: ForwardBatch, row: int, token: int) -> ForwardBatch:
        batch.positions[token] += 1
        return batch

    injector.change_next_batch(ids["e"], change)


def _context_one_too_long(injector: FaultInjector, ids: Ids) -> None:
    injector.context_one_too_long(ids["e"])  # e holds 11 tokens: slot 11 of its page 2 is not its own


# -- scheduling slips ------------------------------------------------------------------------------------
def _forced_preemption(injector: FaultInjector, ids: Ids) -> None:
    injector.preempt(ids["e"])  # no fault: e is recomputed, its pages revived from the prefix cache


def _recompute_skips_token(injector: FaultInjector, ids: Ids) -> None:
    injector.preempt(ids["e"])
    injector.skip_cached_token(ids["e"])


def _abort_mid_step(injector: FaultInjector, ids: Ids) -> None:
    injector.abort_mid_step(ids["e"])


def _late_write(injector: FaultInjector, ids: Ids) -> None:
    injector.late_forward(ids["e"], delay=6)  # e aborted after step 6; its freed page goes to wave 2


def _late_store_after_abort(injector: FaultInjector, ids: Ids) -> None:
    injector.late_store(ids["e"], "abort", nth=3)  # e's page goes to a request that fills it: hit there


def _late_store_after_preemption(injector: FaultInjector, ids: Ids) -> None:
    injector.late_store(ids["e"], "preempt", nth=3)


# -- byte faults -----------------------------------------------------------------------------------------
def _stray_write(injector: FaultInjector, ids: Ids) -> int:
    page = _table(injector, ids, "e")[0]
    injector.stray_write(page, 1, _table(injector, ids, "c")[0], 1)
    return page


def _bit_flip(injector: FaultInjector, ids: Ids) -> int:
    page = _table(injector, ids, "e")[0]
    injector.bit_flip(page)
    return page


def _bit_flip_shared(injector: FaultInjector, ids: Ids) -> int:
    page = _table(injector, ids, "c")[0]  # held by c and d, attached by h and i: all would read it
    injector.bit_flip(page)
    return page


FAULTS = (
    Fault("premature_free", "tags", (), _premature_free, is_repaired=True),
    Fault("premature_free_sealing", "tags", (), _premature_free_sealing, is_repaired=True),
    Fault("double_free", "tags", (), _double_free, is_repaired=True),
    Fault("stale_prefix_hit", "tags", ("f",), _stale_prefix_hit),
    Fault("hash_collision", "off", (), _hash_collision),
    Fault("off_by_one", "tags", ("d",), _off_by_one),
    Fault("seal_wrong_entry", "tags", ("d",), _seal_wrong_entry),
    Fault("seal_swap", "tags", ("d", "e"), _seal_swap),
    Fault("row_one_longer", "tags", ("e",), _row_one_longer),
    Fault("prefix_unwritten", "tags", ("h",), _prefix_unwritten),
    Fault("misdirected_write", "tags", ("e",), _misdirected_write),
    Fault("slot_one_off", "tags", ("e",), _slot_one_off),
    Fault("slot_one_off_prefill", "tags", ("h",), _slot_one_off_prefill),
    Fault("position_one_off", "tags", ("e",), _position_one_off),
    Fault("context_one_too_long", "tags", ("e",), _context_one_too_long),
    Fault("forced_preemption", "off", (), _forced_preemption),
    Fault("recompute_skips_token", "tags", ("e",), _recompute_skips_token),
    Fault("abort_mid_step", "off", (), _abort_mid_step, aborted=("e",)),
    Fault("late_write", "tags", (), _late_write, aborted=("e",)),
    Fault("late_store_after_abort", "tags", ("j",), _late_store_after_abort, aborted=("e",)),
    Fault("late_store_after_preemption", "tags", ("e",), _late_store_after_preemption),
    Fault("stray_write", "full", ("e",), _stray_write),
    Fault("bit_flip", "full", ("e",), _bit_flip),
    Fault("bit_flip_shared", "full", ("c", "d", "h", "i"), _bit_flip_shared),
)
