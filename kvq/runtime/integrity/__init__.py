"""The checked KV pool (`--kv-integrity {off,tags,full}`): page tags, the per-step check and the abort path
(the fault injector and drill that test it live in `kvq.drill`).

`off` builds nothing (`make_tracker` returns None and the engine and block manager skip every hook);
`tags` checks every page a step reads or writes against tags derived from each request's own state, and
every slot it reads against the stamp its writer's store left there (`kernels.integrity.stamp_check`);
`full` also re-hashes sampled bytes of every sealed page a step reads. Files: `tags.py` (pure tag
functions), `page_sample.py` (which bytes `full` hashes), `tracker.py` (state and check), `mismatch.py`,
`abort.py` (ending only the hit request).
Limits, by design: `tags` binds pages and slots to owners, positions and content identity, not to bytes
(a byte changed in place by no store passes; `full` catches it in a sampled byte of a full page, not in
the page being filled); a late store into any slot a step reads, the page being filled included, leaves
its writer's stamp and is caught; a page a
failed check names keeps the hit request's reference (it may be another's now), so such a slip can
leak that page; the check runs once per step, before the forward: bytes that go astray inside a forward
(not through its checked slot mapping) can be read by that same forward before the next check.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from kvq.runtime.integrity.page_sample import make_page_sample
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.kv_pool import KVPool


def make_tracker(mode: str, kv_pool: KVPool, num_checked_layers: int | None = None) -> TagTracker | None:
    """The tracker for `mode` over `kv_pool`: None for "off" (no integrity work at all). The pool holds slot
    stamps exactly when checked (`KVPool.set_checked`: a switch on an existing pool adds or drops them).
    Only the pool's first `num_checked_layers` layers (default all) are checked: the MTP layer's, after
    them, only shapes drafts, which verification checks against the model, and its rows lag the model's
    by a position."""
    kv_pool.set_checked(mode != "off")
    if mode == "off":
        return None
    assert kv_pool.stamps is not None
    num_layers = kv_pool.num_layers if num_checked_layers is None else num_checked_layers
    stamps = kv_pool.stamps if num_layers == kv_pool.num_layers else kv_pool.stamps[..., :num_layers]
    if mode == "tags":
        return TagTracker(
            kv_pool.num_pages, kv_pool.page_size, kv_pool.device, stamps=stamps, backend=kv_pool.backend
        )
    assert mode == "full", mode
    pool_bytes = kv_pool.page_bytes_view()[:num_layers]
    num_parts = pool_bytes.shape[1]
    sample = make_page_sample(
        num_layers, kv_pool.page_size, kv_pool.row_bytes, kv_pool.device, num_parts=num_parts
    )
    return TagTracker(
        kv_pool.num_pages,
        kv_pool.page_size,
        kv_pool.device,
        pool_bytes,
        sample,
        stamps=stamps,
        backend=kv_pool.backend,
    )
