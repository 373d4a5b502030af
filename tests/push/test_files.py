"""`kvq push` sends the checkpoint, not the folder: stray files stay home unless `--include` names them,
dotfiles always; a folder whose calibration is half there, or a bad repo id, is refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.cli import build_app
from kvq.errors import KvqError
from tests.push.conftest import tree
from tests.push.hub_server import HubServer
from tests.push.test_push_cmd import CARD, REPO, TOKEN, finish, kvq_push, push_env


def _add_strays(folder: Path) -> set[str]:
    (folder / ".env").write_text("HF_TOKEN=hf_private\n")
    (folder / "secret.txt").write_text("do not publish\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.md").write_text("# notes\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.lock").write_text("")
    return {".env", "secret.txt", "sub/notes.md", ".cache/x.lock"}


def _dry_run(folder: Path, *extra: str):
    argv = ["push", str(folder), REPO, *CARD, "--dry-run", *extra]
    return CliRunner().invoke(build_app("push"), argv, catch_exceptions=False)


def _listed(output: str) -> list[str]:
    lines = output.split("would upload")[1].splitlines()[1:]
    return [line.split()[0] for line in lines if line.startswith("  ")]


def test_dry_run_lists_only_the_checkpoint_and_names_what_stays(folder, monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    checkpoint = set(tree(folder))
    strays = _add_strays(folder)
    result = _dry_run(folder)
    assert result.exit_code == 0, result.output
    assert _listed(result.stdout) == sorted([*checkpoint, "README.md"])
    assert (
        "not uploaded (not part of the checkpoint; --include PATTERN sends one): secret.txt, sub/notes.md"
        in (result.stderr)
    )
    assert "not uploaded (dotfiles never are): .cache/x.lock, .env" in result.stderr
    assert not strays & set(_listed(result.stdout))

    result = _dry_run(folder, "--include", "sub/*.md")
    assert _listed(result.stdout) == sorted([*checkpoint, "README.md", "sub/notes.md"])


@pytest.mark.parametrize("pattern", [".env", "*.env", "nothing/*"])
def test_include_that_matches_nothing_sendable_is_refused(folder, monkeypatch, pattern: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    _add_strays(folder)
    result = CliRunner().invoke(
        build_app("push"), ["push", str(folder), REPO, *CARD, "--dry-run", "--include", pattern]
    )
    assert isinstance(result.exception, KvqError)
    assert f"--include {pattern!r} matches no file" in str(result.exception)
    assert "dotfiles are never uploaded" in str(result.exception)


def test_upload_sends_only_the_checkpoint_and_what_include_adds(folder, tmp_path) -> None:
    checkpoint = tree(folder)
    _add_strays(folder)
    with HubServer(TOKEN) as hub:
        code, output = finish(
            kvq_push([str(folder), REPO, *CARD, "--include", "sub/*.md"], push_env(tmp_path, hub.endpoint))
        )
        assert code == 0, output
        files = dict(hub.files(REPO, "main"))
    assert files.pop("README.md").startswith(b"---\n")
    assert files == {**checkpoint, "sub/notes.md": b"# notes\n"}


@pytest.mark.parametrize("repo_id", ["bad repo", "a/b/c", "org--x/y", "org/model-"])
def test_a_bad_repo_id_is_refused_before_any_work(tmp_path, repo_id: str) -> None:
    result = CliRunner().invoke(build_app("push"), ["push", str(tmp_path / "nope"), repo_id, "--dry-run"])
    assert isinstance(result.exception, KvqError)
    message = str(result.exception)
    assert message.startswith(f"REPO_ID {repo_id!r} is not a Hub repository id") and "nope" not in message


def _drop_scheme(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (folder / "config.json").write_text(json.dumps(config))


def _old_manifest(folder: Path) -> None:
    manifest = json.loads((folder / "kvq_manifest.json").read_text())
    del manifest["kv_calibration"]
    (folder / "kvq_manifest.json").write_text(json.dumps(manifest))


def _other_scales(folder: Path) -> None:
    scales = folder / "kv_scales.safetensors"
    data = bytearray(scales.read_bytes())
    data[-1] ^= 0x01
    scales.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (_drop_scheme, "config.json has no kv_cache_scheme"),
        (_old_manifest, "records no calibration"),
        (_other_scales, "is not the file kvq_manifest.json recorded"),
    ],
    ids=["config-old", "manifest-old", "scales-replaced"],
)
def test_a_half_calibrated_folder_is_refused(folder, monkeypatch, damage, fragment: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    damage(folder)
    result = CliRunner().invoke(build_app("push"), ["push", str(folder), REPO, *CARD, "--dry-run"])
    assert isinstance(result.exception, KvqError)
    assert f"{folder}: half-calibrated" in str(result.exception) and fragment in str(result.exception)
    assert "re-run the kvq calibrate command" in str(result.exception)
