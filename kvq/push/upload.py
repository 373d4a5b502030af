"""Upload a folder to the Hugging Face Hub with huggingface_hub: create the repo (and branch), then one
commit of the folder's files plus the model card (sent from memory: the folder is never written to),
which re-run after an interruption skips what already arrived (huggingface_hub's pre-upload check).

The endpoint is `HF_ENDPOINT` (read here, not only when huggingface_hub is first imported), the token is
`HF_TOKEN` or the stored `hf auth login` one; it is passed to huggingface_hub and never printed (it is
masked in any error message). Which files go is `kvq.push.files`' choice. Imports huggingface_hub lazily.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvq.errors import KvqError


def check_repo_id(repo_id: str) -> None:
    """`KvqError` for a name the Hub would refuse (huggingface_hub's own rule), before any work."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise KvqError(
            f"REPO_ID {repo_id!r} is not a Hub repository id: {str(e).split(':')[0]}; use e.g. "
            "my-org/SmolLM2-135M-w4a16"
        ) from e


def hub_token() -> str:
    """HF_TOKEN, else the token `hf auth login` stored; `KvqError` when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise KvqError(
            "no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)"
        )
    return token


def upload(
    root: Path,
    files: Sequence[str],
    repo_id: str,
    card: tuple[str, str],
    *,
    private: bool,
    revision: str | None,
    token: str,
    commit_message: str,
) -> str:
    """Create `repo_id` if needed and commit `files` of `root` to it (at `revision`), with `card` (name,
    text) in place of any file of that name in `root`; the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    card_name, card_text = card
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(Path(root) / name))
        for name in files
        if name != card_name
    ]
    operations.append(CommitOperationAdd(path_in_repo=card_name, path_or_fileobj=card_text.encode()))

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.create_commit(
            repo_id=repo_id, operations=operations, commit_message=commit_message, revision=revision
        )
    except Exception as e:  # huggingface_hub's, httpx's and hf_xet's errors: the network edge
        message = str(e).replace(token, "***")
        raise KvqError(
            f"upload of {root} to {api.endpoint}/{repo_id} failed: {message}; re-run the same command to "
            "resume (files already uploaded are not sent again)"
        ) from e
    return str(info.commit_url)
