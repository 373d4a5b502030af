"""`kvq push` end to end against a Hub on loopback (tests/push/hub_server.py) that speaks the endpoints
huggingface_hub and hf_xet call: every file arrives byte-identical, an interrupted upload completes when
re-run, `--dry-run` prints card and file list and opens no connection, the token is never printed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvq.cli import build_app
from kvq.errors import KvqError
from tests.push.conftest import tree
from tests.push.hub_server import HubServer

TOKEN = "hf_loopbackSECRETtoken1234"
REPO = "kvq-test/tiny-w4a16"
CARD = ["--base-model", "kvq-test/tiny", "--license", "apache-2.0"]


def push_env(tmp_path: Path, endpoint: str, token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    if token is not None:
        env["HF_TOKEN"] = token
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    return env


def kvq_push(args: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvq", "push", *args]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    out, err = process.communicate(timeout=600)
    return process.returncode, out + err


def test_dry_run_prints_card_and_files_and_opens_no_connection(
    published, folder, tmp_path, monkeypatch
) -> None:
    report = tmp_path / "eval.json"
    report.write_text(json.dumps(published[1]))
    before = tree(folder)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: any request would fail

    def refuse(*args, **kwargs):
        raise AssertionError(f"kvq push --dry-run opened a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    argv = ["push", str(folder), REPO, "--eval", str(report), *CARD, "--dry-run"]
    result = CliRunner().invoke(build_app("push"), argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert tree(folder) == before  # nothing written: no README.md
    listed = [
        line.split()[0] for line in result.output.split("would upload")[1].splitlines()[1:] if line.strip()
    ]
    assert listed == sorted([*before, "README.md"])
    assert result.output.startswith("---\nbase_model: kvq-test/tiny\n") and "## Evaluation" in result.output
    assert TOKEN not in result.output


def pushed(hub: HubServer, folder: Path, rev: str = "main") -> dict[str, bytes]:
    """The Hub's files at `rev` less the card, after checking the card is the one kvq writes."""
    files = dict(hub.files(REPO, rev))
    card = files.pop("README.md").decode()
    assert card.startswith("---\nbase_model: kvq-test/tiny\n") and "license: apache-2.0" in card
    return files


def test_push_uploads_every_file_byte_identical(published, folder, tmp_path) -> None:
    before = tree(folder)
    with HubServer(TOKEN) as hub:
        code, output = finish(
            kvq_push([str(folder), REPO, *CARD, "--private"], push_env(tmp_path, hub.endpoint))
        )
        assert code == 0, output
        assert tree(folder) == before and "README.md" not in before  # the card went up from memory
        assert pushed(hub, folder) == before
        assert hub.state.repos[REPO]["private"] and len(hub.state.commits) == 1
        assert any(path.startswith("/v1/xorbs/") for _m, path in hub.state.log)  # shards went through Xet
        code, output = finish(
            kvq_push([str(folder), REPO, *CARD, "--revision", "int4"], push_env(tmp_path, hub.endpoint))
        )
        assert code == 0, output
        assert pushed(hub, folder, "int4") == before
    assert TOKEN not in output


def test_an_interrupted_upload_completes_when_re_run(folder, tmp_path) -> None:
    with HubServer(TOKEN) as hub:
        env = push_env(tmp_path, hub.endpoint)
        hub.state.hold_xorbs.set()
        first = kvq_push([str(folder), REPO, *CARD], env, start_new_session=True)
        assert hub.state.xorb_waiting.wait(300), "the upload never reached the xorbs"
        os.killpg(first.pid, signal.SIGKILL)  # interrupted mid-transfer
        first.wait(60)
        hub.state.hold_xorbs.clear()
        hub.state.release.set()
        assert not hub.state.commits and REPO in hub.state.repos  # repo created, nothing committed
        code, output = finish(kvq_push([str(folder), REPO, *CARD], env))
        assert code == 0, output
        assert pushed(hub, folder) == tree(folder)
        num_requests = len(hub.state.log)
        code, output = finish(kvq_push([str(folder), REPO, *CARD], env))  # all there: no data, no commit
        assert code == 0, output
        sent = [path for _m, path in hub.state.log[num_requests:]]
        assert len(hub.state.commits) == 1 and not [p for p in sent if p.startswith("/v1/xorbs")]


def test_push_refuses_an_altered_shard_and_a_missing_token(folder, tmp_path) -> None:
    with HubServer(TOKEN) as hub:
        code, output = finish(
            kvq_push([str(folder), REPO, *CARD], push_env(tmp_path, hub.endpoint, token=None))
        )
        assert code == 2 and "no Hugging Face token: set HF_TOKEN or run `hf auth login`" in output
        shard = folder / "model-00003-of-00003.safetensors"
        data = bytearray(shard.read_bytes())
        data[-8] ^= 0xFF
        shard.write_bytes(bytes(data))
        code, output = finish(kvq_push([str(folder), REPO, *CARD], push_env(tmp_path, hub.endpoint)))
        assert code == 2 and f"{shard}: sha256" in output and "Traceback" not in output
        assert not hub.state.repos  # refused before any request


def test_require_engine_refuses_what_kvq_check_says_would_not_load(folder, monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # --dry-run: nothing is sent either way
    app, base = build_app("push"), ["push", str(folder), REPO, *CARD, "--dry-run", "--require-engine", "vllm"]
    result = CliRunner().invoke(app, [*base, "--require-engine", "sglang"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "would upload" in result.output
    result = CliRunner().invoke(app, [*base, "--tp", "3"])  # o_proj's 256 inputs / 3 ranks: not whole groups
    assert isinstance(result.exception, KvqError) and "would upload" not in result.output
    assert "at tp 3, vllm would not load it, so it is not pushed" in str(result.exception)
    assert "[vllm.wna16-tp-group] model.layers.0.self_attn.o_proj" in str(result.exception)
