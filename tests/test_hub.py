"""hardway.formats.hub against a local HTTP server that plays the model hub: sizes, ETags, LFS redirects with X-Linked-Etag
(sha256), Range + If-Range, dropped connections, stalls, 5xx, 401/403/404, and two real processes at once."""

import errno
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import requests

import hardway.formats.hub as hub_module
from hardway.formats.hub import HubError, checkpoint, download, is_complete, models_dir, shakespeare_path

REPO = "some-org/tiny-model"
WEIGHTS = bytes(range(256)) * 4096  # 1 MiB, every byte position distinguishable
FILES = {
    "config.json": json.dumps({"model_type": "gpt2", "n_layer": 2}).encode(),
    "model.safetensors": WEIGHTS,
    "vocab.json": b'{"a": 0}',
    "merges.txt": b"#version: 0.2\na b\n",
}
LFS_MIN = 100_000  # like the hub: files this big are LFS files, served by a redirect to storage that carries their sha256


class FakeHub:
    """Serves /{repo}/resolve/{revision}/{name} like the hub: small files with an ETag, LFS files by a 302 to
    /lfs/{sha256} whose headers carry X-Linked-Size and X-Linked-Etag. Honours Range and If-Range. Records requests."""

    def __init__(self):
        self.files = {}  # URL path -> bytes
        self.status = {}  # URL path -> a status code it always answers
        self.fail = {}  # URL path -> status codes to answer first, one per request (then it serves normally)
        self.drops = {}  # URL path -> (bytes to send before closing the socket, how many GETs to do it for)
        self.after_drop = {}  # URL path -> a function called after each drop (to change the file on the server)
        self.no_length = set()  # URL paths whose GET sends no Content-Length (the end is when the socket closes)
        self.no_size = set()  # URL paths whose HEAD says no size either
        self.stall = {}  # URL path -> (bytes to send, then seconds of silence)
        self.slow = {}  # URL path -> seconds to spread the body over
        self.hang = set()  # URL paths that accept the connection and then answer nothing for 5 s
        self.requests = []  # (method, URL path, headers)
        self.content_gets = []  # (resolve URL path, headers) of each GET answered with content (200 or 206)
        self.done_at = {}  # URL path -> time the last complete body was sent

    def add(self, files, repo=REPO, revision="main"):
        for name, data in files.items():
            self.files[f"/{repo}/resolve/{revision}/{name}"] = data

    def path(self, name, repo=REPO, revision="main"):
        return f"/{repo}/resolve/{revision}/{name}"

    def gets(self, name, repo=REPO, revision="main"):
        """The headers of each GET answered with the file's content (not the redirect before it)."""
        return [h for p, h in self.content_gets if p == self.path(name, repo, revision)]


def etag_of(data: bytes) -> str:
    return '"' + hashlib.sha1(data).hexdigest() + '"'


def make_handler(hub):
    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # socket timeout: a stuck client cannot hold a server thread forever

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self.serve(send_body=False)

        def do_GET(self):
            self.serve(send_body=True)

        def reply(self, status, headers=()):
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def serve(self, send_body):
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path, dict(self.headers)))
            if path in hub.hang:
                time.sleep(5)
                return
            if path.startswith("/lfs/"):  # storage: the file whose content has this sha256
                resolved = next((p for p, d in hub.files.items() if hashlib.sha256(d).hexdigest() == path[5:]), None)
                if resolved is None:
                    return self.reply(404)
                return self.send_file(resolved, hub.files[resolved], send_body, '"storage-' + path[5:13] + '"')
            if hub.fail.get(path):
                return self.reply(hub.fail[path].pop(0))
            if path in hub.status or path not in hub.files:
                return self.reply(hub.status.get(path, 404))
            data = hub.files[path]
            if len(data) >= LFS_MIN:  # an LFS file: the hub redirects to storage, with the file's size and sha256
                sha = hashlib.sha256(data).hexdigest()
                port = self.server.server_address[1]
                return self.reply(302, [("Location", f"http://127.0.0.1:{port}/lfs/{sha}"), ("X-Linked-Size", str(len(data))),
                                        ("X-Linked-Etag", f'"{sha}"'), ("ETag", '"not-the-content-hash"')])
            self.send_file(path, data, send_body, etag_of(data))

        def send_file(self, path, data, send_body, etag):
            start = 0
            m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if_range = self.headers.get("If-Range")
            if m and (if_range is None or if_range == etag):  # If-Range: the rest only if the version is the same
                start = int(m[1])
                if start >= len(data):
                    return self.reply(416, [("Content-Range", f"bytes */{len(data)}")])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            if send_body:
                hub.content_gets.append((path, dict(self.headers)))
            self.send_header("ETag", etag)
            resolve_path = path
            if send_body and resolve_path in hub.no_length:
                self.close_connection = True  # HTTP/1.0: the body ends when the socket closes
            elif send_body or resolve_path not in hub.no_size:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not send_body:
                return
            cut, times = hub.drops.get(resolve_path, (None, 0))
            if times > 0:
                hub.drops[resolve_path] = (cut, times - 1)
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-file
                if resolve_path in hub.after_drop:
                    hub.after_drop[resolve_path]()
                return
            if resolve_path in hub.stall:
                sent, silence = hub.stall[resolve_path]
                self.wfile.write(body[:sent])
                self.wfile.flush()
                time.sleep(silence)
                return
            if resolve_path in hub.slow:
                pieces = 20
                for i in range(pieces):
                    if i:  # pause between pieces, not after the last: done_at is when the client can have it all
                        time.sleep(hub.slow[resolve_path] / pieces)
                    self.wfile.write(body[i * len(body) // pieces : (i + 1) * len(body) // pieces])
                    self.wfile.flush()
            else:
                self.wfile.write(body)
            hub.done_at[resolve_path] = time.time()

    return Handler


@pytest.fixture
def hub(monkeypatch):
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))  # ephemeral port
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    deadline = threading.Timer(120, server.shutdown)  # stops by itself even if a test never returns
    deadline.daemon = True
    deadline.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "5")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub_module, "RETRY_WAIT", 0.0)
    yield fake
    deadline.cancel()
    server.shutdown()
    server.server_close()
    thread.join(5)


def files_in(folder):
    """The files a download left, bookkeeping (.download/) aside."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and hub_module.STATE_DIR not in p.relative_to(folder).parts}


def partial(folder, name):
    return folder / hub_module.STATE_DIR / (name + ".incomplete")


# ---------------------------------------------------------------- the happy paths


def test_full_download_of_a_model(hub, tmp_path):
    hub.add(FILES)
    folder = download(REPO, local_dir=tmp_path / "m")
    assert folder == tmp_path / "m"
    assert files_in(folder) == FILES  # optional files the repo lacks (404) are simply absent
    for optional in ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert [m for m, p, _ in hub.requests if p == hub.path(optional)] == ["HEAD"]
    assert is_complete(folder) and is_complete(folder, ["config.json"]) and not is_complete(folder, ["tokenizer.json"])
    # The weights came from storage after the hub's redirect, and were checked against the hub's sha256.
    assert [p for m, p, _ in hub.requests if m == "GET" and p.startswith("/lfs/")] == [f"/lfs/{hashlib.sha256(WEIGHTS).hexdigest()}"]


def test_default_local_dir_is_under_models_dir(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    hub.add(FILES)
    assert download(REPO) == models_dir() / REPO == tmp_path / REPO
    assert files_in(tmp_path / REPO) == FILES


def test_explicit_filenames_and_revision(hub, tmp_path):
    hub.add({"config.json": b"{}", "sub/extra.bin": b"xyz"}, revision="v1.0")
    download(REPO, ["config.json", "sub/extra.bin"], revision="v1.0", local_dir=tmp_path)
    assert files_in(tmp_path) == {"config.json": b"{}", "sub/extra.bin": b"xyz"}
    assert len(hub.gets("config.json", revision="v1.0")) == 1
    assert is_complete(tmp_path, ["config.json", "sub/extra.bin"]) and not is_complete(tmp_path)  # not a whole model


def test_sharded_model_falls_back_to_the_index(hub, tmp_path):
    shards = {"model-00001-of-00002.safetensors": b"A" * 1000, "model-00002-of-00002.safetensors": b"B" * 500}
    index = {"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(), **shards}
    hub.add(files)
    download(REPO, local_dir=tmp_path)
    assert files_in(tmp_path) == files
    assert [m for m, p, _ in hub.requests if p == hub.path("model.safetensors")] == ["HEAD"]  # asked first, 404, then the index


def test_repo_without_weights(hub, tmp_path):
    hub.add({"config.json": b"{}"})
    with pytest.raises(HubError, match=f"{REPO} has neither model.safetensors nor model.safetensors.index.json"):
        download(REPO, local_dir=tmp_path)
    assert not is_complete(tmp_path)


def test_complete_files_are_skipped(hub, tmp_path):
    hub.add(FILES)
    download(REPO, local_dir=tmp_path)
    first = len(hub.requests)
    download(REPO, local_dir=tmp_path)
    second = [(method, path.rsplit("/", 1)[1]) for method, path, _ in hub.requests[first:]]
    # Every present file is checked with one HEAD (its version) and not fetched again.
    assert sorted(name for method, name in second if method == "HEAD" and name in FILES) == sorted(FILES)
    assert [name for method, name in second if method == "GET"] == []
    assert files_in(tmp_path) == FILES


def test_a_file_that_changed_on_the_hub_is_downloaded_again(hub, tmp_path):
    hub.add({"config.json": b'{"v": 1}'})
    download(REPO, ["config.json"], local_dir=tmp_path)
    hub.add({"config.json": b'{"v": 2}'})  # same size, new content, new ETag
    download(REPO, ["config.json"], local_dir=tmp_path)
    assert (tmp_path / "config.json").read_bytes() == b'{"v": 2}'
    hub.add({"config.json": b'{"new": true}'})
    (tmp_path / "config.json").write_bytes(b"{}")  # a file put there by hand, of another size
    download(REPO, ["config.json"], local_dir=tmp_path)
    assert (tmp_path / "config.json").read_bytes() == b'{"new": true}'


def test_a_large_file_put_there_by_hand_is_kept_when_its_sha256_matches(hub, tmp_path):
    hub.add({"model.safetensors": WEIGHTS})
    (tmp_path / "model.safetensors").write_bytes(WEIGHTS)  # no record of ours: the hub's sha256 decides
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert hub.gets("model.safetensors") == []
    (tmp_path / "model.safetensors").write_bytes(WEIGHTS[::-1])  # same size, other bytes
    (tmp_path / hub_module.STATE_DIR / "model.safetensors.json").unlink()
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert len(hub.gets("model.safetensors")) == 1 and (tmp_path / "model.safetensors").read_bytes() == WEIGHTS


# ---------------------------------------------------------------- resuming, and never a wrong file (findings 2 and 3)


def test_resume_after_the_connection_drops_mid_file(hub, tmp_path):
    hub.add({"model.safetensors": WEIGHTS})
    hub.drops[hub.path("model.safetensors")] = (300_000, 1)  # the first GET closes the socket after 300,000 bytes
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    gets = hub.gets("model.safetensors")
    assert len(gets) == 2 and "Range" not in gets[0]
    # Resumed, not restarted: the retry asks for the rest of the same version (If-Range: the ETag storage gave).
    kept = int(re.fullmatch(r"bytes=(\d+)-", gets[1]["Range"])[1])
    assert 0 < kept <= 300_000
    assert gets[1]["If-Range"] == '"storage-' + hashlib.sha256(WEIGHTS).hexdigest()[:8] + '"'
    assert (tmp_path / "model.safetensors").read_bytes() == WEIGHTS
    assert not partial(tmp_path, "model.safetensors").exists()


def test_a_later_run_resumes_an_interrupted_download(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "RETRIES", 1)
    hub.add({"model.safetensors": WEIGHTS})
    hub.drops[hub.path("model.safetensors")] = (300_000, 1)
    with pytest.raises(HubError, match="after 1 attempts: ChunkedEncodingError"):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    kept = partial(tmp_path, "model.safetensors").stat().st_size
    assert 0 < kept <= 300_000 and not (tmp_path / "model.safetensors").exists()
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert hub.gets("model.safetensors")[-1]["Range"] == f"bytes={kept}-"
    assert (tmp_path / "model.safetensors").read_bytes() == WEIGHTS


def test_a_partial_file_of_unknown_version_starts_over(hub, tmp_path):
    hub.add({"config.json": b"{}"})
    partial(tmp_path, "config.json").parent.mkdir(parents=True)
    partial(tmp_path, "config.json").write_bytes(b"x")  # no record of which version it belongs to
    download(REPO, ["config.json"], local_dir=tmp_path)
    assert [h.get("Range") for h in hub.gets("config.json")] == [None]
    assert files_in(tmp_path) == {"config.json": b"{}"}


def test_resume_after_the_file_changed_on_the_hub_never_mixes_versions(hub, tmp_path):
    # Finding 2: same size, new content, new ETag between two attempts. The old Range resume stored old[:n] + new[n:].
    new = bytes(reversed(WEIGHTS))
    hub.add({"model.safetensors": WEIGHTS})
    path = hub.path("model.safetensors")
    hub.drops[path] = (300_000, 1)
    hub.after_drop[path] = lambda: hub.add({"model.safetensors": new})
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == new
    assert [h.get("Range") for h in hub.gets("model.safetensors")] == [None, None]  # a new version: from byte 0


def test_if_range_turns_a_resume_onto_a_changed_file_into_a_full_download(hub, tmp_path):
    # The version changed between our HEAD and our GET (or the stored ETag is stale): If-Range makes the server
    # send the whole file (200) instead of the tail of another version (206). Small file, no sha256 to catch it.
    data = bytes(range(200)) * 200  # 40,000 bytes: not an LFS file
    hub.add({"tokenizer.json": data})
    download(REPO, ["tokenizer.json"], local_dir=tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    partial(tmp_path, "tokenizer.json").write_bytes(b"\0" * 10_000)  # a partial of a version the server no longer has
    record = tmp_path / hub_module.STATE_DIR / "tokenizer.json.json"
    record.write_text(json.dumps({"hub_etag": etag_of(data).strip('"'), "etag": '"an-old-version"'}))
    download(REPO, ["tokenizer.json"], local_dir=tmp_path)
    last = hub.gets("tokenizer.json")[-1]
    assert last["Range"] == "bytes=10000-" and last["If-Range"] == '"an-old-version"'
    assert (tmp_path / "tokenizer.json").read_bytes() == data


def test_a_server_that_sends_no_length_and_closes_halfway(hub, tmp_path, monkeypatch):
    # Finding 3: no Content-Length on the GET, the socket closed halfway. The size the hub gave (HEAD) catches it.
    monkeypatch.setattr(hub_module, "RETRIES", 3)
    hub.add({"model.safetensors": WEIGHTS})
    path = hub.path("model.safetensors")
    hub.no_length.add(path)
    hub.drops[path] = (100_000, 99)  # each attempt gets 100,000 bytes further, then the server closes
    with pytest.raises(HubError, match="after 3 attempts: the transfer ended after 3.* of 1,048,576 bytes"):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert not (tmp_path / "model.safetensors").exists()  # nothing under the final name
    hub.drops.clear()
    download(REPO, ["model.safetensors"], local_dir=tmp_path)  # a rerun fetches it (resuming), and checks it
    assert (tmp_path / "model.safetensors").read_bytes() == WEIGHTS


def test_a_server_that_never_says_the_size_is_refused(hub, tmp_path):
    hub.add({"config.json": b"{}"})
    hub.no_size.add(hub.path("config.json"))
    with pytest.raises(HubError, match="did not say the size of config.json"):
        download(REPO, ["config.json"], local_dir=tmp_path)
    assert hub.gets("config.json") == [] and not (tmp_path / "config.json").exists()


def test_bytes_that_do_not_match_the_hubs_sha256_are_not_kept(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "RETRIES", 2)
    hub.add({"model.safetensors": WEIGHTS})
    real_sha256 = hub_module._sha256
    monkeypatch.setattr(hub_module, "_sha256", lambda path: "0" * 64)  # as if every byte arrived corrupted
    with pytest.raises(HubError, match="have sha256 0{64}, the hub says " + hashlib.sha256(WEIGHTS).hexdigest()):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert not (tmp_path / "model.safetensors").exists() and not partial(tmp_path, "model.safetensors").exists()
    monkeypatch.setattr(hub_module, "_sha256", real_sha256)
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == WEIGHTS


def test_no_partial_file_under_the_final_name_after_a_failure(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "RETRIES", 3)
    hub.add({"model.safetensors": WEIGHTS})
    hub.drops[hub.path("model.safetensors")] = (100_000, 99)  # every attempt drops after 100,000 bytes
    with pytest.raises(HubError, match="network error downloading model.safetensors from some-org/tiny-model .* after 3 attempts"):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    kept = partial(tmp_path, "model.safetensors").read_bytes()  # kept, to resume later
    assert 0 < len(kept) < len(WEIGHTS) and kept == WEIGHTS[: len(kept)]
    ranges = [h.get("Range") for h in hub.gets("model.safetensors")]
    starts = [int(r.split("=")[1].rstrip("-")) for r in ranges[1:]]
    assert ranges[0] is None and len(starts) == 2 and 0 < starts[0] < starts[1] <= len(kept)


# ---------------------------------------------------------------- two processes at once (finding 1)


def test_two_processes_downloading_one_repo_at_once(hub, tmp_path):
    hub.add(FILES)
    hub.slow[hub.path("model.safetensors")] = 3.0  # the weights take 3 s: long enough for the two to overlap
    code = ("import sys, time; from hardway.formats.hub import download; print(time.time(), flush=True); "
            "download(sys.argv[1], local_dir=sys.argv[2]); print('done', flush=True)")
    folder = tmp_path / "m"
    procs = [subprocess.Popen([sys.executable, "-c", code, REPO, str(folder)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.split()[-1] == "done", err[-2000:]
    started = [float(out.split()[0]) for out, _ in outs]
    assert max(started) < hub.done_at[hub.path("model.safetensors")], "the two processes did not overlap"
    assert files_in(folder) == FILES  # byte-exact: nothing appended, nothing mixed
    assert len(hub.gets("model.safetensors")) == 1  # the second waited for the first's lock, then found the file done
    assert is_complete(folder)
    assert not list((folder / hub_module.STATE_DIR).glob("*.incomplete"))


# ---------------------------------------------------------------- a repo that fails partway (finding 4)


@pytest.mark.parametrize("failure", ["500", "offline"])
def test_a_repo_that_fails_partway_resumes_on_the_next_run(hub, tmp_path, monkeypatch, failure):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    monkeypatch.setattr(hub_module, "RETRIES", 2)
    files = {**FILES, "tokenizer.json": b'{"model": {}}'}
    hub.add(files)
    if failure == "500":
        hub.status[hub.path("tokenizer.json")] = 500
    else:  # the network goes away after the weights
        def go_offline(*args, **kwargs):
            raise requests.ConnectionError("network is unreachable")
        real_head = requests.Session.head
        monkeypatch.setattr(requests.Session, "head", lambda self, url, **kw: (
            go_offline() if url.endswith("tokenizer.json") else real_head(self, url, **kw)))
    with pytest.raises(HubError, match="tokenizer.json from some-org/tiny-model .* after 2 attempts"):
        checkpoint(REPO)
    folder = tmp_path / REPO
    assert (folder / "model.safetensors").exists() and not is_complete(folder)
    # The next run does not take the folder as complete: it goes back to the hub and finishes.
    hub.status.clear()
    if failure == "offline":
        monkeypatch.setattr(requests.Session, "head", real_head)  # back online
    before = len(hub.requests)
    assert checkpoint(REPO) == folder
    assert files_in(folder) == files and is_complete(folder)
    again = [(m, p.rsplit("/", 1)[1]) for m, p, _ in hub.requests[before:]]
    assert ("GET", "tokenizer.json") in again and not [p for m, p in again if m == "GET" and p in FILES]
    n = len(hub.requests)
    assert checkpoint(REPO) == folder and len(hub.requests) == n  # complete now: no network at all


# ---------------------------------------------------------------- 5xx, stalls, bad endpoints, a full disk


def test_5xx_is_retried_with_backoff(hub, tmp_path, monkeypatch):
    waits = []
    monkeypatch.setattr(hub_module.time, "sleep", waits.append)
    monkeypatch.setattr(hub_module, "RETRY_WAIT", 1.0)
    hub.add({"config.json": b"{}"})
    hub.fail[hub.path("config.json")] = [503, 502, 500]
    download(REPO, ["config.json"], local_dir=tmp_path)
    assert files_in(tmp_path) == {"config.json": b"{}"}
    assert waits == [1.0, 2.0, 4.0]  # doubled each time


def test_a_5xx_that_persists_fails_after_a_bounded_number_of_attempts(hub, tmp_path, monkeypatch):
    hub.add({"config.json": b"{}"})
    hub.status[hub.path("config.json")] = 503
    with pytest.raises(HubError, match=f"config.json from {REPO} .* after 5 attempts: the server answered 503"):
        download(REPO, ["config.json"], local_dir=tmp_path)
    assert len([m for m, p, _ in hub.requests if p == hub.path("config.json")]) == hub_module.RETRIES == 5


def test_a_stalled_transfer_fails_within_the_stated_time(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "0.5")  # seconds without a byte
    monkeypatch.setattr(hub_module, "RETRIES", 2)
    hub.add({"model.safetensors": WEIGHTS})
    hub.stall[hub.path("model.safetensors")] = (200_000, 60)  # 200,000 bytes, then a minute of silence
    start = time.monotonic()
    with pytest.raises(HubError, match="after 2 attempts: .*([Tt]imed? ?out)"):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert time.monotonic() - start < 45  # 2 attempts × 0.5 s of silence, not the server's minute (60 s)
    assert not (tmp_path / "model.safetensors").exists()


def test_a_server_that_never_answers_times_out(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "0.3")
    monkeypatch.setattr(hub_module, "RETRIES", 2)
    hub.add({"config.json": b"{}"})
    hub.hang.add(hub.path("config.json"))  # accepts the connection, answers nothing for 5 s
    with pytest.raises(HubError, match="after 2 attempts: .*([Tt]imed? ?out)"):
        download(REPO, ["config.json"], local_dir=tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("endpoint", ["127.0.0.1:8080", "huggingface.co", "ftp://mirror.example", "http://"])
def test_hf_endpoint_without_a_scheme_is_one_clear_line(tmp_path, monkeypatch, endpoint):
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(ValueError, match=f"HF_ENDPOINT={re.escape(repr(endpoint))} is not an http\\(s\\) URL: give the scheme too"):
        download(REPO, ["config.json"], local_dir=tmp_path / "m")
    assert not (tmp_path / "m").exists()  # reported before anything was written


def test_a_bad_download_timeout_is_one_clear_line(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "soon")
    hub.add({"config.json": b"{}"})
    with pytest.raises(ValueError, match="HF_HUB_DOWNLOAD_TIMEOUT='soon' is not a positive number of seconds"):
        download(REPO, ["config.json"], local_dir=tmp_path)


def test_disk_full_names_the_path(hub, tmp_path, monkeypatch):
    hub.add({"model.safetensors": WEIGHTS})

    class FullDisk:
        def __init__(self, *args, **kwargs):
            self.file = open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hub_module, "open", FullDisk, raising=False)  # every write of a download: ENOSPC
    with pytest.raises(HubError) as error:
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert str(error.value).startswith(f"disk full while writing {partial(tmp_path, 'model.safetensors')} (model.safetensors from {REPO})")
    assert not (tmp_path / "model.safetensors").exists()


def test_too_little_free_space_is_reported_before_downloading(hub, tmp_path, monkeypatch):
    hub.add({"model.safetensors": WEIGHTS})
    monkeypatch.setattr(hub_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(HubError, match=f"not enough disk space for model.safetensors in {re.escape(str(tmp_path / hub_module.STATE_DIR))}: "
                                       "it needs 1,048,576 more bytes, 1,000 are free"):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert hub.gets("model.safetensors") == []


# ---------------------------------------------------------------- auth, endpoints, names


@pytest.mark.parametrize("status", [401, 403])
def test_gated_or_private_repo(hub, tmp_path, status):
    hub.add(FILES)
    hub.status[hub.path("config.json")] = status
    with pytest.raises(HubError) as error:
        download(REPO, local_dir=tmp_path)
    message = str(error.value)
    assert f"{status} for config.json in {REPO}" in message
    assert "gated or private" in message and "accept its license" in message and "HF_TOKEN" in message
    assert "HF_TOKEN is not set" in message
    assert files_in(tmp_path) == {} and not partial(tmp_path, "config.json").exists()


def test_gated_message_says_when_the_token_was_refused(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    hub.status[hub.path("config.json")] = 401
    with pytest.raises(HubError, match="HF_TOKEN is set, but the hub refused it"):
        download(REPO, ["config.json"], local_dir=tmp_path)


def test_missing_file_names_the_file_and_the_repo(hub, tmp_path):
    with pytest.raises(HubError, match=f"404: config.json not found in {REPO} at revision 'main'"):
        download(REPO, local_dir=tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_token_is_sent_as_bearer(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret123")
    hub.add(FILES)
    download(REPO, local_dir=tmp_path)
    assert hub.requests and all(h.get("Authorization") == "Bearer hf_secret123" for _, _, h in hub.requests)


def test_no_token_no_authorization_header(hub, tmp_path):
    hub.add(FILES)
    download(REPO, local_dir=tmp_path)
    assert all("Authorization" not in h for _, _, h in hub.requests)


def test_hf_endpoint_is_honoured(hub, tmp_path, monkeypatch):
    # The fixture points HF_ENDPOINT at the fake hub; every request of a download arrived there, at the hub's URLs.
    hub.add(FILES)
    download(REPO, local_dir=tmp_path)
    assert {p for _, p, _ in hub.requests} >= {hub.path(name) for name in FILES}
    # And pointing it somewhere else (a closed port) sends nothing here.
    before = len(hub.requests)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}/")
    monkeypatch.setattr(hub_module, "RETRIES", 2)
    with pytest.raises(HubError, match=f"network error downloading config.json from {REPO} \\(http://127.0.0.1:{closed_port}/{REPO}/resolve/main/config.json\\)"):
        download(REPO, ["config.json"], local_dir=tmp_path / "other")
    assert len(hub.requests) == before


@pytest.mark.parametrize("repo_id", ["../etc", "a/b/c", "", "a b", "/abs"])
def test_bad_repo_ids_are_refused(repo_id, tmp_path):
    with pytest.raises(ValueError, match="is not a hub repo id"):
        download(repo_id, local_dir=tmp_path)


@pytest.mark.parametrize("filename", ["../x", "/etc/passwd", "a/../../b", "", ".download/complete.json"])
def test_bad_filenames_are_refused(hub, filename, tmp_path):
    with pytest.raises(ValueError, match="is not a relative file name"):
        download(REPO, [filename], local_dir=tmp_path / "m")
    assert hub.requests == [] and not (tmp_path / "m").exists()


# ---------------------------------------------------------------- checkpoint(), datasets, the text corpus


def test_checkpoint_downloads_an_absent_folder(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    hub.add(FILES)
    folder = checkpoint(REPO)
    assert folder == tmp_path / REPO and files_in(folder) == FILES
    n = len(hub.requests)
    assert checkpoint(REPO) == folder and len(hub.requests) == n  # complete: no network at all


def test_checkpoint_of_a_standin_never_touches_the_network(monkeypatch, capsys):
    def no_network(*args, **kwargs):
        raise AssertionError("checkpoint() went to the network for a folder that exists")

    monkeypatch.setattr(requests.Session, "request", no_network)
    monkeypatch.setattr(hub_module, "_BANNERS_SHOWN", set())  # the banner shows once per folder and process
    folder = checkpoint("openai-community/gpt2")  # HARDWAY_MODELS points at the stand-ins in every test run
    assert folder == models_dir() / "openai-community/gpt2" and (folder / "model.safetensors").exists()
    assert "STAND-IN" in capsys.readouterr().out


def test_dataset_files_come_from_the_datasets_path(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    name = "wikitext-2-raw-v1/test-00000-of-00001.parquet"
    hub.files[f"/datasets/Salesforce/wikitext/resolve/main/{name}"] = b"PAR1 data"
    path = hub_module.dataset_file("Salesforce/wikitext", name)
    assert path == tmp_path / "datasets" / "Salesforce/wikitext" / name and path.read_bytes() == b"PAR1 data"
    assert {p for _, p, _ in hub.requests} == {f"/datasets/Salesforce/wikitext/resolve/main/{name}"}
    n = len(hub.requests)
    hub_module.dataset_file("Salesforce/wikitext", name)  # complete: no second request
    assert len(hub.requests) == n
    with pytest.raises(ValueError, match="name the files"):
        download("Salesforce/wikitext", repo_type="dataset")


def test_the_standin_banner_shows_once_per_folder(monkeypatch, capsys):
    monkeypatch.setattr(hub_module, "_BANNERS_SHOWN", set())
    checkpoint("openai-community/gpt2")
    checkpoint("openai-community/gpt2")
    assert capsys.readouterr().out.count("STAND-IN") == 1


def test_shakespeare_path_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="shakespeare.txt"):
        shakespeare_path()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shakespeare.txt").write_text("To be", encoding="utf-8")
    assert shakespeare_path().read_text(encoding="utf-8") == "To be"


def test_shakespeare_is_downloaded_once_with_the_same_care_and_without_the_hub_token(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret123")
    text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 2000
    hub.files["/tiny/input.txt"] = text
    monkeypatch.setattr(hub_module, "TINY_SHAKESPEARE_URL", os.environ["HF_ENDPOINT"] + "/tiny/input.txt")
    hub.drops["/tiny/input.txt"] = (5000, 1)  # the first GET drops: resumed, checked against the size
    assert shakespeare_path() == tmp_path / "data" / "shakespeare.txt"
    assert (tmp_path / "data" / "shakespeare.txt").read_bytes() == text
    assert all("Authorization" not in h for _, _, h in hub.requests)  # the hub's token stays with the hub
    n = len(hub.requests)
    shakespeare_path()
    assert len(hub.requests) == n
    (tmp_path / "data" / "shakespeare.txt").unlink()
    hub.status["/tiny/input.txt"] = 404
    with pytest.raises(HubError, match="could not download TinyShakespeare: .*404.* Or put any UTF-8 text file at"):
        shakespeare_path()
