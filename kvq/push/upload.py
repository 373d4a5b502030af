"""Upload a folder to the Hugging Face Hub with huggingface_hub: create the repo (and branch), then one
commit of the folder's files plus the model card (sent from memory: the folder is never written to),
which re-run after an interruption skips what already arrived (huggingface_hub's pre-upload check).

The endpoint is `HF_ENDPOINT` (read here, not only when huggingface_hub is first imported), the token is
`HF_TOKEN` or the stored `hf auth login` one; it is passed to huggingface_hub and never printed (it is
masked in any error message). `upload_files` is the list of the folder's files that are sent (what
`upload_folder` would send), computed without a connection. Imports huggingface_hub lazily.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvq.checkpoint.write import TMP_SUFFIX
from kvq.errors import KvqError

IGNORE_PATTERNS = [f"*{TMP_SUFFIX}"]


def upload_files(root: Path) -> list[str]:
    """The paths (relative, posix) `upload_folder` uploads from `root`: its files except .git and
    huggingface_hub's cache folders (its DEFAULT_IGNORE_PATTERNS) and kvq's temporary files."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    root = Path(root).resolve()
    files = sorted(p.relative_to(root).as_posix() for p in root.glob("**/*") if p.is_file())
    return list(filter_repo_objects(files, ignore_patterns=IGNORE_PATTERNS + DEFAULT_IGNORE_PATTERNS))


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
    repo_id: str,
    card: tuple[str, str],
    *,
    private: bool,
    revision: str | None,
    token: str,
    commit_message: str,
) -> str:
    """Create `repo_id` if needed and commit `root`'s files to it (at `revision`), with `card` (name,
    text) in place of any file of that name in `root`; the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    card_name, card_text = card
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(Path(root) / name))
        for name in upload_files(root)
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
