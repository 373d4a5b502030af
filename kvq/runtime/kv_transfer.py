"""KV page handoff between two engines (the prefill/decode split): what is sent, and its check on arrival.

A prefill engine computes a prompt's KV pages; `export_handoff` copies the pages that hold the K/V of all
prompt tokens but the last: the decode engine computes the last one in its first decode step, so every
sampled token comes from the decode side's weights and sampler (the prefill side's own next-token logits
are not used). Pages travel whole: every layer, every part (`KVPool.page_bytes_view`), so GQA K/V pages
and the MLA latent rows, DSA index keys included, travel alike, each with its integrity tag and a digest
of its bytes. The tag is the sealed tag of the page's prefix chain hash (`block_manager.chain_hash` over
the page's tokens, a partial last page over the tokens it holds), so the receiver derives the tag it
expects from the request's own prompt, as the checked pool does. With the sender's pool checked, each page
also carries its slot stamps and the sender's writer tag: every slot that holds a prompt token must carry
that writer's stamp at its position (a late write into the page before export is refused); a checked receiver
stamps the pages it copies in with its own writer tags, in the same copy. `verify_handoff` recomputes both on
arrival and raises `KvTransferError` naming the request and the page; the caller ends only that request.
`kv_identity` is what two workers must agree on for their pages to mean the same thing: the KV cache
spec (`kvq.checkpoint.kv_cache_spec`), the pool layout and page size, the FP8 KV scales and the
tokenizer; `check_same_kv` refuses by field name. Imports torch and kvq.runtime.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch

from kvq.errors import KvqError
from kvq.runtime.block_manager import ROOT_HASH, chain_hash
from kvq.runtime.integrity.tags import format_tag, sealed_tag
from kvq.runtime.kv_pool import KVPool

DIGEST_BYTES = 16


class KvTransferError(KvqError):
    """A handoff that cannot be used: a page whose tag or bytes are not what was sent, or two workers that
    do not agree on the KV cache. Ends only the request it names."""


@dataclass
class PageRecord:
    """One prompt page in transit: its logical index in the request, tag, digest and bytes."""

    logical_index: int
    tag: int  # signed int64, `sealed_tag` of the page's prefix chain hash
    digest: bytes  # blake2b of `data`'s bytes
    data: torch.Tensor  # [L, C, page_size * row_bytes] uint8, on the host
    stamps: torch.Tensor | None = None  # [page_size, L] int64: the sender's slot stamps (checked pool)
    writer: int = 0  # the writer tag the sender's stamps carry (0: the sender did not stamp)


@dataclass
class KVHandoff:
    """A prefilled request: its prompt and the pages holding the K/V of `prompt_token_ids[:-1]`."""

    prompt_token_ids: list[int]
    identity: dict[str, str]  # the sender's `kv_identity`
    pages: list[PageRecord] = field(default_factory=list)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V the pages hold: all of the prompt but its last token."""
        return len(self.prompt_token_ids) - 1

    @property
    def num_bytes(self) -> int:
        return sum(p.data.numel() for p in self.pages)


def page_digest(data: torch.Tensor) -> bytes:
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=DIGEST_BYTES).digest()


def transfer_tags(token_ids: list[int], page_size: int) -> list[int]:
    """The tag of each page holding `token_ids`: sealed tags of the chain hash, the last page over the
    tokens it holds (a full page's tag is the one the checked pool gives it)."""
    tags, previous = [], ROOT_HASH
    for start in range(0, len(token_ids), page_size):
        previous = chain_hash(previous, token_ids[start : start + page_size])
        tags.append(sealed_tag(previous))
    return tags


def kv_identity(
    spec: object, layout: object, page_size: int, scales: list[dict], tokenizer: object, model_type: str
) -> dict[str, str]:
    """The fields two workers must agree on for pages to transfer, each as a string (compared by name)."""
    identity = {name: str(value) for name, value in asdict(spec).items()}  # type: ignore[call-overload]
    identity.update(model_type=model_type, layout=repr(layout), page_size=str(page_size))
    if getattr(layout, "dtype", None) == torch.float8_e4m3fn:
        names = getattr(layout, "scale_names", ())
        digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
        for layer in scales:
            for name in names:
                scale = layer.get(name)
                digest.update(b"none" if scale is None else scale.float().cpu().numpy().tobytes())
        identity["kv_scales"] = digest.hexdigest()
    identity["tokenizer"] = tokenizer_digest(tokenizer)
    return identity


def tokenizer_digest(tokenizer: object) -> str:
    """A digest of everything that maps text to token ids (a fast tokenizer's full JSON, else its vocab)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))  # type: ignore[attr-defined]
    special = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True)
    return hashlib.blake2b((text + special).encode(), digest_size=DIGEST_BYTES).hexdigest()


def check_same_kv(
    sender: dict[str, str], receiver: dict[str, str], sender_name: str, receiver_name: str
) -> None:
    """`KvTransferError` naming every field the two workers disagree on."""
    fields = sorted(set(sender) | set(receiver))
    diffs = [f for f in fields if sender.get(f) != receiver.get(f)]
    if not diffs:
        return
    shown = "; ".join(f"{f}: {sender.get(f, 'absent')} vs {receiver.get(f, 'absent')}" for f in diffs)
    raise KvTransferError(
        f"the prefill worker ({sender_name}) and the decode worker ({receiver_name}) disagree on the KV "
        f"cache ({shown}); serve checkpoints of the same model with the same --page-size and "
        "--kv-cache-dtype (and, for FP8 KV, the same calibrated scales)"
    )


def export_handoff(
    pool: KVPool,
    prompt: list[int],
    block_table: list[int],
    identity: dict[str, str],
    writers: list[int] | None = None,
) -> KVHandoff:
    """The pages holding the K/V of `prompt[:-1]` (written by the prefill forward), copied to the host,
    with their slot stamps and `writers` (the sender's writer tag per page, when its pool is checked)."""
    handoff = KVHandoff(list(prompt), identity)
    num_pages = -(-handoff.num_computed_tokens // pool.page_size)
    if not num_pages:
        return handoff
    page_ids = torch.tensor(block_table[:num_pages], dtype=torch.int64, device=pool.device)
    data = pool.page_bytes_view().index_select(2, page_ids).cpu()  # [L, C, n, page_size * row_bytes]
    stamps = None  # only a checked pool's pages carry stamps: [n, page_size, L]
    if pool.stamps is not None and writers is not None:
        stamps = pool.stamps.index_select(0, page_ids).cpu()
    tags = transfer_tags(prompt[:-1], pool.page_size)
    for i in range(num_pages):
        page = data[:, :, i].contiguous()
        writer = writers[i] if writers is not None else 0
        page_stamps = stamps[i] if stamps is not None else None
        handoff.pages.append(PageRecord(i, tags[i], page_digest(page), page, page_stamps, writer))
    return handoff


def check_page_stamps(page: PageRecord, num_tokens: int, page_size: int, where: str) -> None:
    """A page's stamps (when the sender stamped) are its writer's at every position it holds."""
    if page.stamps is None or not page.writer:
        return
    start = page.logical_index * page_size
    positions = torch.arange(start, min(start + page_size, num_tokens))
    expected = (page.writer ^ positions)[:, None]  # [n, 1]
    wrong = (page.stamps[: positions.numel()] != expected).any(dim=1).nonzero().flatten().tolist()
    if wrong:
        position = start + wrong[0]
        found, own = format_tag(int(page.stamps[wrong[0]].max())), format_tag(page.writer ^ position)
        raise KvTransferError(
            f"{where}: the slot of position {position} carries stamp {found}, not its writer's {own}: a "
            "write landed in the page after its request's; the request was stopped"
        )


def verify_handoff(handoff: KVHandoff, identity: dict[str, str], request: str, pool: KVPool) -> None:
    """Check a handoff on arrival: same KV cache as ours, every prompt page present, in order, with the tag
    the prompt gives it and the bytes its digest says. `KvTransferError` names `request` and the page."""
    check_same_kv(handoff.identity, identity, "sender", "this worker")
    expected = transfer_tags(handoff.prompt_token_ids[:-1], pool.page_size)
    if [p.logical_index for p in handoff.pages] != list(range(len(expected))):
        raise KvTransferError(
            f"{request}: the handoff holds logical pages {[p.logical_index for p in handoff.pages]} but its "
            f"{len(handoff.prompt_token_ids)}-token prompt needs pages 0..{len(expected) - 1}; "
            "the request was stopped"
        )
    shape = (pool.num_layers, pool.layout.num_parts, pool.page_size * pool.row_bytes)
    for page, tag in zip(handoff.pages, expected, strict=True):
        where = f"{request}: transferred KV page {page.logical_index}"
        if page.tag != tag:
            raise KvTransferError(
                f"{where} carries tag {format_tag(page.tag)} but the prompt's tokens give "
                f"{format_tag(tag)}: the page is not this request's; the request was stopped"
            )
        if tuple(page.data.shape) != shape or page.data.dtype != torch.uint8:
            raise KvTransferError(
                f"{where} is {page.data.dtype} {tuple(page.data.shape)}, expected uint8 {shape}; "
                "the request was stopped"
            )
        check_page_stamps(page, handoff.num_computed_tokens, pool.page_size, where)
        found = page_digest(page.data)
        if found != page.digest:
            raise KvTransferError(
                f"{where} bytes digest expected {page.digest.hex()}, found {found.hex()}: its bytes "
                "changed in transit; the request was stopped"
            )


def write_pages(
    pool: KVPool,
    block_table: list[int],
    pages: list[PageRecord],
    first: int,
    writers: list[int] | None = None,
) -> None:
    """Copy transferred pages `first..` into the pool pages `block_table` gives them (earlier pages were
    prefix hits, already here); with `writers` (the receiver's writer tag per logical page, its checked
    pool), each slot's stamp in the same copy: this pool's writer at the slot's position."""
    todo = pages[first:]
    if not todo:
        return
    page_ids = torch.tensor(
        [block_table[p.logical_index] for p in todo], dtype=torch.int64, device=pool.device
    )
    data = torch.stack([p.data for p in todo], dim=2).to(pool.device)  # [L, C, n, page_size * row_bytes]
    pool.page_bytes_view().index_copy_(2, page_ids, data)
    if writers is not None and pool.stamps is not None:
        size = pool.page_size
        positions = torch.tensor([[p.logical_index * size + s for s in range(size)] for p in todo])  # [n, S]
        own = torch.tensor([writers[p.logical_index] for p in todo])[:, None] ^ positions
        pool.stamps.index_copy_(0, page_ids, own[:, :, None].expand(-1, -1, pool.num_layers).to(pool.device))
