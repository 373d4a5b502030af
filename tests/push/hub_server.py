"""A Hugging Face Hub on loopback, speaking the endpoints huggingface_hub 1.x's `create_repo`,
`create_branch` and `upload_folder` call (read from its hf_api.py, _commit_api.py, _upload_pipeline.py and
utils/_xet.py), and the Xet CAS API hf_xet uploads large files through (xet-core spec/api.md):

  POST /api/repos/create                        {name, organization, visibility} -> {url}; 409 if it exists
  POST /api/models/{repo}/branch/{branch}       create a branch from main
  POST /api/validate-yaml                       a README.md's front matter -> {errors, warnings}
  POST /api/models/{repo}/preupload/{rev}       per file: uploadMode lfs|regular, shouldIgnore, oid
  GET  /api/models/{repo}/xet-write-token/{rev} X-Xet-Cas-Url / -Access-Token / -Token-Expiration
  GET  /api/models/{repo}/revision/{rev}        repo_info (when nothing needed committing)
  POST /api/models/{repo}/commit/{rev}          ndjson: header, file (base64), lfsFile (sha256 oid)
  GET  /api/agent-harnesses                     huggingface_hub's user-agent registry: empty
  GET  /v1/chunks/{prefix}/{hash}               global dedup: 404, nothing known
  POST /v1/xorb-grants/{prefix}/{hash}          404: hf_xet then uploads directly (xet-core
                                                api_changes/update_261006_xorb_upload_grants.md)
  POST /v1/xorbs/default/{hash}                 a serialized xorb -> {was_inserted}
  POST /v1/shards, /v2/shards                   file reconstructions -> {result} / NDJSON progress
                                                frames ending in {"type": "result"}; files rebuilt
  POST /v1/telemetry                            hf_xet's transfer summary: accepted, ignored

Hub calls must carry `Authorization: Bearer <token>`, CAS calls the Xet token it handed out. A file
committed as lfsFile must have been rebuilt from uploaded xorbs with that sha256. `hold_xorbs` makes
xorb uploads wait (to interrupt a client mid-upload). Every request is logged as (method, path).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

from tests.push import xet_format

XET_TOKEN = "xet-loopback-token"
LFS_PATTERNS = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|h5|msgpack|onnx)$")
MAX_REGULAR_BYTES = 10 * 1024 * 1024


@dataclass
class HubState:
    token: str
    repos: dict[str, dict] = field(default_factory=dict)  # repo -> {private, branches: {rev: {path: bytes}}}
    xorbs: dict[str, bytes] = field(default_factory=dict)
    cas_files: dict[str, bytes] = field(default_factory=dict)  # sha256 hex -> bytes, rebuilt from shards
    log: list[tuple[str, str]] = field(default_factory=list)
    commits: list[dict] = field(default_factory=list)
    hold_xorbs: threading.Event = field(default_factory=threading.Event)  # set: xorb uploads wait
    xorb_waiting: threading.Event = field(default_factory=threading.Event)  # a held upload arrived
    release: threading.Event = field(default_factory=threading.Event)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState  # set on the subclass made for each server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while (size := int(self.rfile.readline().strip(), 16)) > 0:
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload: object = None, headers: dict | None = None) -> None:
        body = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self, token: str) -> bool:
        if self.headers.get("Authorization") == f"Bearer {token}":
            return True
        self._send(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def _route(self, method: str) -> None:
        path = self.path.split("?")[0]
        self.state.log.append((method, path))
        body = self._body()
        if (method, path) == ("GET", "/api/agent-harnesses"):
            return self._send(200, {"standardEnvVars": [], "harnesses": {}})
        if path.startswith(("/v1/", "/v2/")):
            if self._authorized(XET_TOKEN):
                self._cas(method, path, body)
            return
        if not self._authorized(self.state.token):
            return
        if (method, path) == ("POST", "/api/repos/create"):
            return self._create_repo(json.loads(body))
        if (method, path) == ("POST", "/api/validate-yaml"):
            return self._validate_yaml(json.loads(body))
        found = re.fullmatch(r"/api/models/([^/]+/[^/]+)/([a-z-]+)/(.+)", path)
        if found is None or found[1] not in self.state.repos:
            return self._send(404, {"error": "Repository not found"})
        repo, action, rev = found[1], found[2], found[3]
        branches = self.state.repos[repo]["branches"]
        if action == "branch" and method == "POST":
            branches.setdefault(rev, dict(branches["main"]))
            return self._send(200, {})
        if rev not in branches:
            return self._send(404, {"error": f"Revision not found: {rev}"})
        if action == "preupload" and method == "POST":
            return self._preupload(branches[rev], json.loads(body))
        if action == "xet-write-token" and method == "GET":
            return self._xet_token()
        if action == "revision" and method == "GET":
            return self._send(200, {"id": repo, "sha": self._head(repo, rev), "siblings": []})
        if action == "commit" and method == "POST":
            return self._commit(repo, rev, body)
        return self._send(404, {"error": f"no route {method} {path}"})

    def _create_repo(self, payload: dict) -> None:
        repo = f"{payload['organization']}/{payload['name']}"
        url = f"http://{self.headers['Host']}/{repo}"
        if repo in self.state.repos:
            return self._send(409, {"error": "You already created this model repo", "url": url})
        private = payload.get("visibility") == "private"
        self.state.repos[repo] = {"private": private, "branches": {"main": {}}, "heads": {}}
        return self._send(200, {"url": url})

    def _validate_yaml(self, payload: dict) -> None:
        text = payload["content"]
        front = text.split("---\n")[1] if text.startswith("---\n") else ""
        try:
            is_mapping = isinstance(yaml.safe_load(front), dict)
        except yaml.YAMLError:
            is_mapping = False
        errors = [] if is_mapping else [{"message": "the front matter is not a YAML mapping"}]
        return self._send(400 if errors else 200, {"errors": errors, "warnings": []})

    def _preupload(self, files: dict[str, bytes], payload: dict) -> None:
        out = []
        for f in payload["files"]:
            sample = base64.b64decode(f["sample"])
            is_lfs = bool(LFS_PATTERNS.match(f["path"])) or f["size"] > MAX_REGULAR_BYTES or b"\0" in sample
            entry = {"path": f["path"], "uploadMode": "lfs" if is_lfs else "regular", "shouldIgnore": False}
            if f["path"] in files:
                data = files[f["path"]]
                entry["oid"] = hashlib.sha256(data).hexdigest() if is_lfs else git_blob_sha1(data)
            out.append(entry)
        return self._send(200, {"files": out, "commitOid": "0" * 40})

    def _xet_token(self) -> None:
        cas, exp = f"http://{self.headers['Host']}", int(time.time()) + 3600
        headers = {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": XET_TOKEN, "X-Xet-Token-Expiration": str(exp)}
        return self._send(200, {"casUrl": cas, "accessToken": XET_TOKEN, "exp": exp}, headers)

    def _commit(self, repo: str, rev: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files = self.state.repos[repo]["branches"][rev]
        added: dict[str, bytes] = {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                added[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                data = self.state.cas_files.get(value["oid"])
                if data is None or len(data) != value["size"]:
                    return self._send(
                        422, {"error": f"LFS object {value['oid']} of {value['path']} not uploaded"}
                    )
                added[value["path"]] = data
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
        files.update(added)
        oid = hashlib.sha1(
            json.dumps(sorted(added)).encode() + str(len(self.state.commits)).encode()
        ).hexdigest()
        self.state.repos[repo]["heads"][rev] = oid
        self.state.commits.append(
            {"repo": repo, "revision": rev, "header": lines[0]["value"], "files": sorted(added)}
        )
        url = f"http://{self.headers['Host']}/{repo}/commit/{oid}"
        return self._send(200, {"commitUrl": url, "commitOid": oid, "success": True, "pullRequestUrl": None})

    def _head(self, repo: str, rev: str) -> str:
        return self.state.repos[repo]["heads"].get(rev, "0" * 40)

    def _cas(self, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path.startswith("/v1/chunks/"):
            return self._send(404, {"error": "chunk not tracked"})
        found = re.fullmatch(r"/v1/xorbs/default/([0-9a-f]{64})", path)
        if found and method == "POST":
            if self.state.hold_xorbs.is_set():
                self.state.xorb_waiting.set()
                self.state.release.wait(60)
                self.close_connection = True
                return  # the client was interrupted meanwhile: nothing stored, no answer
            was_inserted = found[1] not in self.state.xorbs
            self.state.xorbs[found[1]] = body
            return self._send(200, {"was_inserted": was_inserted})
        if method == "POST" and path in ("/v1/shards", "/v2/shards"):
            return self._shard(body, is_v2=path == "/v2/shards")
        if (method, path) == ("POST", "/v1/telemetry"):
            return self._send(200, {})
        return self._send(404, {"error": f"no CAS route {method} {path}"})

    def _shard(self, body: bytes, is_v2: bool) -> None:
        try:
            for info in xet_format.shard_files(body):
                data = xet_format.rebuild(info, self.state.xorbs)
                self.state.cas_files[hashlib.sha256(data).hexdigest()] = data
            error = None
        except (KeyError, ValueError) as e:
            error = f"shard rejected: {e!r}"
        if not is_v2:
            return self._send(400, {"error": error}) if error else self._send(200, {"result": 1})
        # xet-core cas_types ShardUploadEvent, as its local server emits them (handlers.rs post_shard_v2)
        frames = [{"type": "validating", "verified": 0, "total": 1}]
        if error:
            frames.append({"type": "error", "message": error, "retryable": False})
        else:
            frames += [
                {"type": "validating", "verified": 1, "total": 1},
                {"type": "committing", "stage": "uploading"},
                {"type": "committing", "stage": "syncing"},
                {"type": "result"},
            ]
        body = b"".join(json.dumps(f).encode() + b"\n" for f in frames)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class HubServer:
    """`with HubServer(token) as hub:` serves on 127.0.0.1:<free port> until the block ends."""

    def __init__(self, token: str) -> None:
        self.state = HubState(token)
        handler = type("Handler", (HubHandler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self, repo: str, rev: str = "main") -> dict[str, bytes]:
        return self.state.repos[repo]["branches"][rev]
