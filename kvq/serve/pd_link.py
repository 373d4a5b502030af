"""The one-host transport of the prefill/decode split: a Unix socket for messages, shared memory for pages
(and the handoff messages both transports share; torch.distributed's link between hosts is `pd_torch`).

The decode worker listens on a Unix socket (`multiprocessing.connection`, in a directory only its user
reads); a prefill worker connects and says hello with its `kv_identity`, which the decode worker checks
(`kv_transfer.check_same_kv`: a disagreement refuses the connection by field name). A handoff's page
bytes go through one POSIX shared-memory segment per request: the sender writes them, sends the
segment's name with the pages' indices, tags and digests; the receiver copies them out, unlinks the
segment and verifies them (`PDEngine.add_prefilled`). A checked sender's slot stamps and writer tags travel
in the message beside the digests, so the receiver checks them as an in-process handoff does. Messages are
tuples:
  prefill -> decode: ("hello", identity, name), ("handoff", rid, meta, params, segment),
    ("abort", rid)
  decode -> prefill: ("hello", None | error), ("out", rid, RequestOutput), ("refused", rid, message)
Imports torch and kvq.runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Client, Connection
from multiprocessing.shared_memory import SharedMemory

import torch

from kvq.errors import KvqError
from kvq.runtime.kv_transfer import KVHandoff, PageRecord
from kvq.runtime.sampling import SamplingParams
from kvq.serve.pd_torch import TorchLink

Link = Connection | TorchLink  # the shared-memory transport's socket, or torch.distributed's link


@dataclass
class HandoffMeta:
    """A handoff without its page bytes (those are in the segment, page after page)."""

    prompt_token_ids: list[int]
    identity: dict[str, str]
    pages: list[tuple[int, int, bytes]]  # (logical index, tag, digest) per page
    page_shape: tuple[int, ...]
    writers: list[int] = field(default_factory=list)  # the sender's writer tag per page (checked pool)
    stamps: bytes = b""  # the pages' slot stamps, int64 [n, *stamp_shape] (empty: the sender did not stamp)
    stamp_shape: tuple[int, ...] = ()  # [page_size, L]


def send_handoff(conn: Link, request_id: int, handoff: KVHandoff, params: SamplingParams) -> None:
    """Pages into a new shared-memory segment, the rest (and the segment's name) over `conn`."""
    pages = handoff.pages
    meta = HandoffMeta(
        handoff.prompt_token_ids,
        handoff.identity,
        [(p.logical_index, p.tag, p.digest) for p in pages],
        tuple(pages[0].data.shape) if pages else (),
    )
    if pages and all(p.stamps is not None for p in pages):
        stamps = torch.stack([p.stamps for p in pages])  # type: ignore[misc]
        meta.writers = [p.writer for p in pages]
        meta.stamps, meta.stamp_shape = stamps.numpy().tobytes(), tuple(stamps.shape[1:])
    if not pages:  # a one-token prompt: the decode side computes it all
        conn.send(("handoff", request_id, meta, params, None))
        return
    if getattr(conn, "carries_pages", False):  # torch.distributed (`pd_torch`): the bytes in the message
        conn.send(("handoff", request_id, meta, params, torch.cat([p.data.flatten() for p in pages])))
        return
    segment = SharedMemory(create=True, size=handoff.num_bytes)
    # the receiver unlinks it; our resource tracker would otherwise unlink it again at exit, with a warning
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=handoff.num_bytes)
        torch.cat([p.data.flatten() for p in pages], out=flat)
        del flat  # before close: the mapping cannot close while a tensor views it
        conn.send(("handoff", request_id, meta, params, segment.name))
    except BaseException:
        resource_tracker.register(segment._name, "shared_memory")  # type: ignore[attr-defined]  # unlink drops it
        segment.unlink()
        raise
    finally:
        segment.close()


def receive_handoff(meta: HandoffMeta, segment: str | torch.Tensor | None) -> KVHandoff:
    """The handoff a "handoff" message names, its pages copied out of the segment (which is then removed),
    or taken from the message itself (`pd_torch`)."""
    if segment is None:
        return KVHandoff(meta.prompt_token_ids, meta.identity, [])
    count = math.prod(meta.page_shape) * len(meta.pages)
    if isinstance(segment, torch.Tensor):
        if segment.dtype != torch.uint8 or segment.numel() != count:
            raise OSError(f"the message holds {segment.numel()} {segment.dtype} page bytes, expected {count}")
        flat = segment
    else:
        shared = SharedMemory(name=segment)
        try:
            flat = torch.frombuffer(shared.buf, dtype=torch.uint8, count=count).clone()
        finally:
            shared.close()
            shared.unlink()
    data = flat.view(len(meta.pages), *meta.page_shape)
    pages = [PageRecord(index, tag, digest, data[i]) for i, (index, tag, digest) in enumerate(meta.pages)]
    if meta.stamps:
        count = len(pages) * math.prod(meta.stamp_shape)
        if len(meta.stamps) != count * 8 or len(meta.writers) != len(pages):
            raise OSError(
                f"the message holds {len(meta.stamps)} stamp bytes and {len(meta.writers)} writers for "
                f"{len(pages)} pages of {meta.stamp_shape} stamps"
            )
        stamps = torch.frombuffer(bytearray(meta.stamps), dtype=torch.int64)
        stamps = stamps.view(len(pages), *meta.stamp_shape)
        for page, page_stamps, writer in zip(pages, stamps, meta.writers, strict=True):
            page.stamps, page.writer = page_stamps, writer
    return KVHandoff(meta.prompt_token_ids, meta.identity, pages)


def connect(socket_path: str, identity: dict[str, str], name: str, timeout_s: float = 30.0) -> Link:
    """A connection to the decode worker at `socket_path` that accepted our KV identity."""
    try:
        conn = Client(socket_path, family="AF_UNIX")
    except OSError as e:
        raise KvqError(
            f"{socket_path}: no decode worker answers there ({e}); start `kvq serve MODEL --role decode "
            f"--pd-socket {socket_path}` first"
        ) from e
    return hello(conn, identity, name, socket_path, timeout_s)


def hello(conn: Link, identity: dict[str, str], name: str, where: str, timeout_s: float = 30.0) -> Link:
    """`conn` once the decode worker at `where` accepted our KV identity (either transport)."""
    conn.send(("hello", identity, name))
    if not conn.poll(timeout_s):
        conn.close()
        raise KvqError(f"{where}: the decode worker did not answer in {timeout_s:.0f} s")
    kind, error = conn.recv()
    if kind != "hello" or error is not None:
        conn.close()
        raise KvqError(f"{where}: the decode worker refused this prefill worker: {error}")
    return conn
