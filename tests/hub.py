"""A stand-in for the Hugging Face Hub on 127.0.0.1, in a thread: the routes huggingface_hub calls
(a repository's info at a revision, and each file's HEAD and GET with ranges), in the Hub's
layout and headers, so the real huggingface_hub code runs end to end with no network.

    with StandInHub() as hub:
        hub.add("org/model", {"config.json": b"{}"})
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit -> files
    refs: dict[str, str]  # branch or tag -> commit
    token: str | None = None  # gated: only this bearer token may read it


@dataclass
class StandInHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)
    # file name -> how many bytes its next GET sends before the connection breaks (once)
    cut_after: dict[str, int] = field(default_factory=dict)

    def add(self, repo: str, files: dict[str, bytes], ref: str = "main", token: str | None = None) -> str:
        """A commit of `files` under `ref` (a new repository, or a new revision of one); its hash."""
        commit = hashlib.sha1(repo.encode() + ref.encode() + json.dumps(sorted(files)).encode()).hexdigest()
        entry = self.repos.setdefault(repo, Repo({}, {}, token))
        entry.commits[commit] = files
        entry.refs[ref] = commit
        return commit

    def __enter__(self) -> StandInHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="stand-in-hub")
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    # ---- the routes ---------------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo_id = (info or resolve)[1] if (info or resolve) else None
        repo = self.repos.get(repo_id or "")
        if repo is None:
            return self._error(h, 404, "RepoNotFound", f"Repository {repo_id} not found")
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted")
        rev = (info[2] if info else resolve[2]) or "main"
        commit = repo.refs.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = repo.commits[commit]
        if info:
            siblings = [{"rfilename": f, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                        for f, b in sorted(files.items())]
            return self._send(h, 200, json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit,
                                                  "private": False, "siblings": siblings}).encode(),
                              {"Content-Type": "application/json"}, body)
        name = resolve[3]
        if name not in files:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist at {commit}")
        return self._file(h, name, files[name], commit, body)

    def _file(self, h: BaseHTTPRequestHandler, name: str, data: bytes, commit: str, body: bool) -> None:
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = 0
        if (given := h.headers.get("Range")) and (m := re.fullmatch(r"bytes=(\d+)-", given)):
            start = int(m[1])
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        if body and name in self.cut_after:  # a connection that breaks mid-file, once
            sent = self.cut_after.pop(name)
            h.send_response(206 if start else 200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(part)))
            h.end_headers()
            h.wfile.write(part[:sent])
            h.wfile.flush()
            h.close_connection = True
            return
        self._send(h, 206 if start else 200, part, headers, body)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str],
              body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        self._send(h, status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
                   h.command != "HEAD")


def point_at(monkeypatch, url: str) -> None:
    """huggingface_hub in this process (its constants, read when it was imported) and the processes
    it starts (HF_ENDPOINT) talk to `url`."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
