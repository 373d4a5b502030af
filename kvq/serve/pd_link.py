"""The one-host transport of the prefill/decode split: a Unix socket for messages, shared memory for pages.

The decode worker listens on a Unix socket (`multiprocessing.connection`, in a directory only its user
reads); a prefill worker connects and says hello with its `kv_identity`, which the decode worker checks
(`kv_transfer.check_same_kv`: a disagreement refuses the connection by field name). A handoff's page
bytes go through one POSIX shared-memory segment per request: the sender writes them, sends the
segment's name with the pages' indices, tags and digests; the receiver copies them out, unlinks the
segment and verifies them (`PDEngine.add_prefilled`). Messages are tuples:
  prefill -> decode: ("hello", identity, name), ("handoff", rid, meta, params, segment),
    ("abort", rid)
  decode -> prefill: ("hello", None | error), ("out", rid, RequestOutput), ("refused", rid, message)
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Client, Connection
from multiprocessing.shared_memory import SharedMemory

import torch

from kvq.errors import KvqError
from kvq.runtime.kv_transfer import KVHandoff, PageRecord
from kvq.runtime.sampling import SamplingParams


@dataclass
class HandoffMeta:
    """A handoff without its page bytes (those are in the segment, page after page)."""

    prompt_token_ids: list[int]
    first_token_id: int
    identity: dict[str, str]
    pages: list[tuple[int, int, bytes]]  # (logical index, tag, digest) per page
    page_shape: tuple[int, ...]
    generator_state: torch.Tensor | None


def send_handoff(conn: Connection, request_id: int, handoff: KVHandoff, params: SamplingParams) -> None:
    """Pages into a new shared-memory segment, the rest (and the segment's name) over `conn`."""
    page_shape = tuple(handoff.pages[0].data.shape)
    segment = SharedMemory(create=True, size=max(handoff.num_bytes, 1))
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]  # the receiver unlinks it
    try:
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=handoff.num_bytes)
        torch.cat([p.data.flatten() for p in handoff.pages], out=flat)
        del flat
        meta = HandoffMeta(
            handoff.prompt_token_ids,
            handoff.first_token_id,
            handoff.identity,
            [(p.logical_index, p.tag, p.digest) for p in handoff.pages],
            page_shape,
            handoff.generator_state,
        )
        conn.send(("handoff", request_id, meta, params, segment.name))
    except BaseException:
        segment.unlink()
        raise
    finally:
        segment.close()


def receive_handoff(meta: HandoffMeta, segment_name: str) -> KVHandoff:
    """The handoff a "handoff" message names, its pages copied out of the segment (which is then removed)."""
    segment = SharedMemory(name=segment_name)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        page_bytes = 1
        for n in meta.page_shape:
            page_bytes *= n
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=page_bytes * len(meta.pages)).clone()
    finally:
        segment.close()
        segment.unlink()
    data = flat.view(len(meta.pages), *meta.page_shape)
    pages = [PageRecord(index, tag, digest, data[i]) for i, (index, tag, digest) in enumerate(meta.pages)]
    return KVHandoff(meta.prompt_token_ids, meta.first_token_id, meta.identity, pages, meta.generator_state)


def connect(socket_path: str, identity: dict[str, str], name: str, timeout_s: float = 30.0) -> Connection:
    """A connection to the decode worker at `socket_path` that accepted our KV identity."""
    try:
        conn = Client(socket_path, family="AF_UNIX")
    except OSError as e:
        raise KvqError(
            f"{socket_path}: no decode worker answers there ({e}); start `kvq serve MODEL --role decode "
            f"--pd-socket {socket_path}` first"
        ) from e
    conn.send(("hello", identity, name))
    if not conn.poll(timeout_s):
        conn.close()
        raise KvqError(f"{socket_path}: the decode worker did not answer in {timeout_s:.0f} s")
    kind, error = conn.recv()
    if kind != "hello" or error is not None:
        conn.close()
        raise KvqError(f"{socket_path}: the decode worker refused this prefill worker: {error}")
    return conn
