"""The kvq runtime as an lm-evaluation-harness model: `KvqLM(engine)` answers lm-eval's `loglikelihood`,
`loglikelihood_rolling` and `generate_until` requests through a kvq `Engine` (packed INT4 weights, paged
FP8 or BF16 KV), tokenizing, splitting and truncating as lm-eval's `hf` backend does for a causal model.

Log-likelihoods are teacher-forced (`kvq.runtime.scoring`): every request is queued at once, so the
choices of a question share its prompt's KV pages. Imports lm_eval, torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from kvq.errors import KvqError
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.scoring import TeacherForcing, force, run_forced

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from kvq.runtime.engine import Engine
    from kvq.runtime.request import Request

Advance = Callable[[int], None]
Progress = Callable[[str, int], Advance]  # (what, total units) -> advance(n)
MAX_GEN_TOKS = 256  # lm-eval's default for generate_until
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]  # (strings, context ids, continuation ids)


def no_progress(_what: str, _total: int) -> Advance:
    return lambda _n: None


class GreedyForcing(TeacherForcing):
    """Teacher forcing that also records whether every forced token was the argmax (lm-eval's is_greedy)."""

    def __init__(self) -> None:
        super().__init__()
        self.is_greedy: dict[int, bool] = {}

    def __call__(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.forced]
        if rows:
            best = logits[rows].argmax(dim=-1).tolist()
            for row, top in zip(rows, best, strict=True):
                seq = seqs[row]
                wanted = self.forced[seq.seq_id][seq.num_tokens - seq.num_prompt_tokens]
                self.is_greedy[seq.seq_id] = self.is_greedy.get(seq.seq_id, True) and top == wanted
        super().__call__(seqs, logits, token_ids)


class KvqLM(TemplateLM):
    """lm-eval's `LM` over one kvq engine; `label` names it in progress bars."""

    def __init__(self, engine: Engine, label: str = "kvq", progress: Progress = no_progress) -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.label = label
        self.progress = progress

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.ckpt.root).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: object) -> list[int]:
        """The tokenizer's own default for special tokens, none when the text already starts with BOS."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = getattr(self.tokenizer, "bos_token", None)
        if add_special_tokens is None and bos and string.startswith(bos):
            options = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **options)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], **kwargs: object
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), is greedy) per request, the context cut from the left to fit."""
        forcing = GreedyForcing()
        seqs = [
            force(self.engine, forcing, _fit(context, continuation, self.max_length), continuation)
            for _strings, context, continuation in requests
        ]
        advance = self.progress(f"loglikelihood: {self.label}", len(seqs))
        run_forced(self.engine, forcing, seqs, advance)
        return [(-forcing.nll[s.seq_id], forcing.is_greedy[s.seq_id]) for s in seqs]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of the whole context (lm-eval's rolling windows,
        the first token predicted from the prefix token)."""
        windows: list[TokenRequest] = []
        counts = []
        for (text,) in (request.args for request in requests):
            rolling = lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            found = [(None, *lm_eval_utils.make_disjoint_window(w)) for w in rolling]
            windows += found
            counts.append(len(found))
        scores = self._loglikelihood_tokens(windows)
        totals, start = [], 0
        for count in counts:
            totals.append(sum(score for score, _greedy in scores[start : start + count]))
            start += count
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Completions stopped at the request's `until` strings or EOS, as lm-eval's `hf` backend returns
        them (the context cut from the left to leave `max_gen_toks`, the stop strings cut off)."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        stops, request_ids = [], []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_gen_toks
            if room < 1:
                raise KvqError(
                    f"max_gen_toks {max_gen_toks} leaves no room for a prompt in {self.max_length}"
                )
            params = _sampling(kwargs, until, max_gen_toks)
            request_ids.append(self.engine.add_request(self.tok_encode(context)[-room:], params))
            stops.append(until)
        texts = self._finish(request_ids, self.progress(f"generate_until: {self.label}", len(request_ids)))
        return [postprocess_generated_text(t, stop, None) for t, stop in zip(texts, stops, strict=True)]

    def _finish(self, request_ids: list[int], advance: Advance) -> list[str]:
        texts: dict[int, str] = {}
        while len(texts) < len(request_ids):
            finished = [out for out in self.engine.step() if out.finished]
            for out in finished:
                if out.finish_reason == "error":
                    raise KvqError(f"a generation request failed: {out.error}")
                texts[out.request_id] = out.text
            if finished:
                advance(len(finished))
        return [texts[r] for r in request_ids]


def _fit(context: list[int], continuation: list[int], max_len: int) -> list[int]:
    """The context cut from the left so context + continuation fit `max_len` tokens (as lm-eval keeps the
    request's last tokens)."""
    excess = len(context) + len(continuation) - max_len
    return context[excess:] if excess > 0 else context


def _sampling(kwargs: dict, until: list[str], max_gen_toks: int) -> SamplingParams:
    """lm-eval's normalized generation kwargs as the engine's sampling parameters (greedy unless
    do_sample); a kwarg the engine does not take is refused by name."""
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if do_sample else 0.0
    kwargs.pop("temperature", None)
    known = {k: kwargs.pop(k) for k in ("top_p", "top_k", "min_p", "seed") if k in kwargs}
    if kwargs:
        raise KvqError(f"generation kwargs {sorted(kwargs)} are not supported by the kvq runtime")
    return SamplingParams(
        temperature=temperature, max_tokens=max_gen_toks, stop=[s for s in until if s], **known
    )
