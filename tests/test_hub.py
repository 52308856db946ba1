"""hardway.hub.download against a local HTTP server that plays the model hub (Range, drops, 401/403/404)."""

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import requests

import hardway.hub as hub_module
from hardway.hub import HubError, checkpoint, download, models_dir

REPO = "some-org/tiny-model"
WEIGHTS = bytes(range(256)) * 4096  # 1 MiB, every byte position distinguishable
FILES = {
    "config.json": json.dumps({"model_type": "gpt2", "n_layer": 2}).encode(),
    "model.safetensors": WEIGHTS,
    "vocab.json": b'{"a": 0}',
    "merges.txt": b"#version: 0.2\na b\n",
}


class FakeHub:
    """Serves files at /{repo}/resolve/{revision}/{name}, honours `Range: bytes=N-`, records every request."""

    def __init__(self):
        self.files = {}  # URL path -> bytes
        self.status = {}  # URL path -> forced status code
        self.drops = {}  # URL path -> (bytes to send before closing the socket, how many GETs to do it for)
        self.stall = set()  # URL paths that never answer in time
        self.requests = []  # (method, URL path, headers)

    def add(self, files, repo=REPO, revision="main"):
        for name, data in files.items():
            self.files[f"/{repo}/resolve/{revision}/{name}"] = data

    def gets(self, name, repo=REPO, revision="main"):
        return [h for m, p, h in self.requests if m == "GET" and p == f"/{repo}/resolve/{revision}/{name}"]


def make_handler(hub):
    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # socket timeout: a stuck client cannot hold a server thread forever

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self.serve(send_body=False)

        def do_GET(self):
            self.serve(send_body=True)

        def serve(self, send_body):
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path, dict(self.headers)))
            if path in hub.stall:
                time.sleep(2)
                return
            if path in hub.status or path not in hub.files:
                self.send_response(hub.status.get(path, 404))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = hub.files[path]
            start = 0
            if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                start = int(m[1])
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not send_body:
                return
            cut, times = hub.drops.get(path, (None, 0))
            if times > 0:
                hub.drops[path] = (cut, times - 1)
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-file
                return
            self.wfile.write(body)

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
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub_module, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(hub_module, "TIMEOUT", (5, 5))
    yield fake
    deadline.cancel()
    server.shutdown()
    server.server_close()
    thread.join(5)


def files_in(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_full_download_of_a_model(hub, tmp_path):
    hub.add(FILES)
    folder = download(REPO, local_dir=tmp_path / "m")
    assert folder == tmp_path / "m"
    assert files_in(folder) == FILES  # optional files the repo lacks (404) are simply absent
    for optional in ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert len(hub.gets(optional)) == 1


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


def test_sharded_model_falls_back_to_the_index(hub, tmp_path):
    shards = {"model-00001-of-00002.safetensors": b"A" * 1000, "model-00002-of-00002.safetensors": b"B" * 500}
    index = {"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(), **shards}
    hub.add(files)
    download(REPO, local_dir=tmp_path)
    assert files_in(tmp_path) == files
    assert len(hub.gets("model.safetensors")) == 1  # asked first, 404, then the index


def test_repo_without_weights(hub, tmp_path):
    hub.add({"config.json": b"{}"})
    with pytest.raises(HubError, match=f"{REPO} has neither model.safetensors nor model.safetensors.index.json"):
        download(REPO, local_dir=tmp_path)


def test_complete_files_are_skipped(hub, tmp_path):
    hub.add(FILES)
    download(REPO, local_dir=tmp_path)
    first = len(hub.requests)
    download(REPO, local_dir=tmp_path)
    second = [(method, path.rsplit("/", 1)[1]) for method, path, _ in hub.requests[first:]]
    # Every present file is checked with one HEAD (its size) and not fetched; GETs go only to absent optional files.
    assert sorted(name for method, name in second if method == "HEAD") == sorted(FILES)
    assert not [name for method, name in second if method == "GET" and name in FILES]
    assert files_in(tmp_path) == FILES


def test_a_file_whose_size_changed_is_downloaded_again(hub, tmp_path):
    hub.add({"config.json": b'{"new": true}'})
    (tmp_path / "config.json").write_bytes(b"{}")
    download(REPO, ["config.json"], local_dir=tmp_path)
    assert (tmp_path / "config.json").read_bytes() == b'{"new": true}'


def test_resume_after_the_connection_drops_mid_file(hub, tmp_path):
    hub.add({"model.safetensors": WEIGHTS})
    path = f"/{REPO}/resolve/main/model.safetensors"
    hub.drops[path] = (300_000, 1)  # the first GET closes the socket after 300,000 of 1,048,576 bytes
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    gets = hub.gets("model.safetensors")
    assert len(gets) == 2
    assert "Range" not in gets[0]
    # Resumed, not restarted: the retry asks for the rest, from what was saved (whole chunks up to the cut).
    kept = int(re.fullmatch(r"bytes=(\d+)-", gets[1]["Range"])[1])
    assert 0 < kept <= 300_000
    assert (tmp_path / "model.safetensors").read_bytes() == WEIGHTS
    assert not (tmp_path / "model.safetensors.incomplete").exists()


def test_resume_from_an_incomplete_file_left_by_an_earlier_run(hub, tmp_path):
    hub.add({"model.safetensors": WEIGHTS})
    (tmp_path / "model.safetensors.incomplete").write_bytes(WEIGHTS[:12345])
    download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert [h.get("Range") for h in hub.gets("model.safetensors")] == ["bytes=12345-"]
    assert (tmp_path / "model.safetensors").read_bytes() == WEIGHTS


def test_a_stale_incomplete_file_longer_than_the_file_starts_over(hub, tmp_path):
    hub.add({"config.json": b"{}"})
    (tmp_path / "config.json.incomplete").write_bytes(b"x" * 100)
    download(REPO, ["config.json"], local_dir=tmp_path)
    assert [h.get("Range") for h in hub.gets("config.json")] == ["bytes=100-", None]  # 416, then from scratch
    assert files_in(tmp_path) == {"config.json": b"{}"}


def test_no_partial_file_under_the_final_name_after_a_failure(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "RETRIES", 3)
    hub.add({"model.safetensors": WEIGHTS})
    hub.drops[f"/{REPO}/resolve/main/model.safetensors"] = (100_000, 99)  # every attempt drops after 100,000 bytes
    with pytest.raises(HubError, match="network error downloading model.safetensors from some-org/tiny-model .* after 3 attempts"):
        download(REPO, ["model.safetensors"], local_dir=tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    partial = (tmp_path / "model.safetensors.incomplete").read_bytes()  # kept, to resume later
    assert 0 < len(partial) < len(WEIGHTS) and partial == WEIGHTS[: len(partial)]
    ranges = [h.get("Range") for h in hub.gets("model.safetensors")]
    starts = [int(r.split("=")[1].rstrip("-")) for r in ranges[1:]]
    assert ranges[0] is None and len(starts) == 2 and 0 < starts[0] < starts[1] <= len(partial)


@pytest.mark.parametrize("status", [401, 403])
def test_gated_or_private_repo(hub, tmp_path, status):
    hub.add(FILES)
    hub.status[f"/{REPO}/resolve/main/config.json"] = status
    with pytest.raises(HubError) as error:
        download(REPO, local_dir=tmp_path)
    message = str(error.value)
    assert f"{status} for config.json in {REPO}" in message
    assert "gated or private" in message and "accept its license" in message and "HF_TOKEN" in message
    assert "HF_TOKEN is not set" in message
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "config.json.incomplete").exists()


def test_gated_message_says_when_the_token_was_refused(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    hub.status[f"/{REPO}/resolve/main/config.json"] = 401
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
    assert {p for _, p, _ in hub.requests} >= {f"/{REPO}/resolve/main/{name}" for name in FILES}
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


def test_a_server_that_never_answers_times_out(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_module, "TIMEOUT", (5, 0.3))
    monkeypatch.setattr(hub_module, "RETRIES", 2)
    hub.add({"config.json": b"{}"})
    hub.stall.add(f"/{REPO}/resolve/main/config.json")
    with pytest.raises(HubError, match="after 2 attempts: .*(Timeout|timed out)"):
        download(REPO, ["config.json"], local_dir=tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("repo_id", ["../etc", "a/b/c", "", "a b", "/abs"])
def test_bad_repo_ids_are_refused(repo_id, tmp_path):
    with pytest.raises(ValueError, match="is not a hub repo id"):
        download(repo_id, local_dir=tmp_path)


@pytest.mark.parametrize("filename", ["../x", "/etc/passwd", "a/../../b", ""])
def test_bad_filenames_are_refused(hub, filename, tmp_path):
    with pytest.raises(ValueError, match="is not a relative file name"):
        download(REPO, [filename], local_dir=tmp_path)
    assert hub.requests == []


def test_checkpoint_downloads_an_absent_folder(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HARDWAY_MODELS", str(tmp_path))
    hub.add(FILES)
    folder = checkpoint(REPO)
    assert folder == tmp_path / REPO and files_in(folder) == FILES
    n = len(hub.requests)
    assert checkpoint(REPO) == folder and len(hub.requests) == n  # present: no network at all


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
    assert [p for _, p, _ in hub.requests] == [f"/datasets/Salesforce/wikitext/resolve/main/{name}"]
    hub_module.dataset_file("Salesforce/wikitext", name)  # present: no second request
    assert len(hub.requests) == 1
    with pytest.raises(ValueError, match="name the files"):
        download("Salesforce/wikitext", repo_type="dataset")


def test_the_standin_banner_shows_once_per_folder(monkeypatch, capsys):
    monkeypatch.setattr(hub_module, "_BANNERS_SHOWN", set())
    checkpoint("openai-community/gpt2")
    checkpoint("openai-community/gpt2")
    assert capsys.readouterr().out.count("STAND-IN") == 1
