"""``insitu view``'s server (insitu.output.report.make_server): the report's own files, under a random token,
and nothing else: not what symbolic links lead to outside the folder, no listings, no dotfiles or
temporary folders, no other file of the folder, whatever the encoding of the path. Without the token,
connections that send nothing or half a request cannot keep a request out, nor use up the server's
threads or descriptors."""
import contextlib
import errno
import http.client
import os
import re
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from insitu.output.export import StepWriter
from insitu.output.report import ACCEPT_BACKOFF, MAX_CONNECTIONS, connection_bound, make_server, served_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def served(tmp_path):
    """An output folder with one step, secrets next to it and inside it, served: (out, server, secret)."""
    secret = tmp_path / "outside"
    (secret / ".ssh").mkdir(parents=True)
    (secret / "passwd").write_text("root:x:0:0\n")
    (secret / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    out = tmp_path / "out"
    StepWriter(out).write(0, None, [("view_000", [[[0.5] * 3] * 4] * 4, [[[0.5] * 3] * 4] * 4)], {"psnr": 20.0})
    (out / "notes.txt").write_text("not part of the report\n")
    (out / ".ssh").mkdir()
    (out / ".ssh" / "id_rsa").write_text("PRIVATE KEY IN OUT\n")
    (out / ".step_000001.abc123.tmp").mkdir()
    (out / ".step_000001.abc123.tmp" / "model.ply").write_text("half a model\n")
    (out / ".metrics.csv.0123456789ab.tmp").write_text("step\n")
    (out / "step_000000" / "secret.txt").write_text("not an output\n")
    (out / "etclink").symlink_to(secret)
    (out / "step_000000" / "views" / "x.png").symlink_to(secret / "passwd")
    (out / "viewer" / "linked.js").symlink_to(secret / ".ssh" / "id_rsa")
    (out / "viewer" / "inside.js").symlink_to(out / "notes.txt")
    (out / "step_000000" / "views" / "copy.png").symlink_to(out / "step_000000" / "views" / "view_000.png")
    with serving(out) as server:
        yield out, server, secret


@contextlib.contextmanager
def serving(out: Path, **options):
    """``make_server(out, port=0, **options)``, serving on a thread until the block ends."""
    server = make_server(out, port=0, **options)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def get(server, path: str, method: str = "GET", timeout: float = 30) -> tuple[int, bytes, dict]:
    """``method path`` exactly as given (no client-side normalisation): (status, body, headers)."""
    c = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=timeout)
    c.putrequest(method, path, skip_accept_encoding=True)
    c.endheaders()
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body, dict(r.getheaders())


def raw_status(port: int, target: bytes) -> int:
    """The status of ``GET target`` sent byte for byte (a NUL byte included, which http.client refuses)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return int(c.makefile("rb").readline().split()[1])


def test_the_report_its_viewer_and_the_step_outputs_are_served_under_the_token(served):
    out, server, _ = served
    t = server.token
    assert server.url() == f"http://localhost:{server.server_address[1]}/{t}/report.html"
    for name in ("report.html", "report.json", "metrics.csv", "viewer/report.js", "viewer/viewer.js",
                 "viewer/vendor/spark/spark.module.min.js", "step_000000/metrics.json",
                 "step_000000/views/view_000.png", "step_000000/views/copy.png"):
        status, body, headers = get(server, f"/{t}/{name}")
        assert status == 200, name
        assert body == (out / name).resolve().read_bytes(), name
    assert get(server, f"/{t}/viewer/viewer.js")[2]["Content-Type"] == "text/javascript"   # module scripts
    status, _, headers = get(server, f"/{t}/")
    assert status == 302 and headers["Location"] == f"/{t}/report.html"
    status, body, _ = get(server, f"/{t}/report.html", method="HEAD")
    assert status == 200 and body == b""


@pytest.mark.parametrize("path", ["/report.html", "/{bad}/report.html", "/{short}/report.html", "/",
                                  "/{t}x/report.html", "/%{hex}/report.html"])
def test_a_wrong_or_missing_token_is_not_found(served, path):
    _, server, _ = served
    t = server.token
    status, body, _ = get(server, path.format(t=t, bad="A" * len(t), short=t[:-1], hex=t.encode().hex()))
    assert status == 404 and b"insitu-data" not in body


@pytest.mark.parametrize("name", ["etclink/passwd", "etclink/.ssh/id_rsa", "step_000000/views/x.png",
                                  "viewer/linked.js", "viewer/inside.js"])
def test_symbolic_links_out_of_the_folder_or_onto_what_is_not_served_are_not_followed(served, name):
    _, server, _ = served
    status, body, _ = get(server, f"/{server.token}/{name}")
    assert status == 404 and b"KEY" not in body and b"root:" not in body and b"not part" not in body


@pytest.mark.parametrize("name", ["", "step_000000", "step_000000/", "step_000000/views/", "viewer/", "viewer",
                                  "etclink/"])
def test_folders_are_not_listed(served, name):
    _, server, _ = served
    status, body, _ = get(server, f"/{server.token}/{name}")
    assert status in (302, 404) and b"<li>" not in body and b"Directory listing" not in body
    assert status == 302 if name == "" else status == 404


@pytest.mark.parametrize("name", [".ssh/id_rsa", ".insitu.lock", ".step_000001.abc123.tmp/model.ply",
                                  ".metrics.csv.0123456789ab.tmp", "notes.txt", "step_000000/secret.txt",
                                  "step_000000/views/../secret.txt", "viewer/../notes.txt"])
def test_dotfiles_temporary_folders_and_other_files_are_not_served(served, name):
    _, server, _ = served
    status, body, _ = get(server, f"/{server.token}/{name}")
    assert status == 404 and b"KEY" not in body and b"half a model" not in body and b"not " not in body


@pytest.mark.parametrize("path", ["/{t}/../{t}/report.html", "/{t}/%2e%2e/outside/passwd", "/{t}/..%2fnotes.txt",
                                  "/{t}/%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/{t}/%252e%252e/notes.txt",
                                  "/{t}/step_000000%2f..%2f..%2fnotes.txt", "/{t}/etclink%2fpasswd",
                                  "/{t}//etc/passwd", "/{t}/%2Fetc%2Fpasswd", "/{t}/report.html%00.png",
                                  "/{t}/%00", "/{t}/step_000000/views/%ff.png", "/{t}/%C0%AE%C0%AE/notes.txt",
                                  "/{t}/viewer\\..\\notes.txt"])
def test_encoded_paths_do_not_leave_the_report(served, path):
    _, server, _ = served
    status, body, _ = get(server, path.format(t=server.token))
    assert status in (400, 404) and b"root:" not in body and b"not part" not in body


def test_served_names_are_the_reports_files_only():
    assert served_name(["report.html"]) and served_name(["step_000120", "views", "view_007.png"])
    assert served_name(["viewer", "vendor", "three", "three.module.min.js"])
    for parts in (["step_000120", "views", "a.txt"], ["step_000120", "notes"], ["step_12", "model.ply"],
                  ["viewer", ".hidden.js"], [".insitu.lock"], ["report.html", ""], ["a\x00b"], []):
        assert not served_name(parts), parts


@contextlib.contextmanager
def connections(port: int, count: int, timeout: float = 30):
    """``count`` connections to ``port`` on 127.0.0.1, opened in order and sending nothing; all closed after."""
    opened = []
    try:
        for _ in range(count):
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=timeout))
        yield opened
    finally:
        for c in opened:
            c.close()


def closed_by_server(c: socket.socket) -> bool:
    """Whether the server closed ``c`` without an answer (waits up to ``c``'s timeout, then raises)."""
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True


def half_request(token: str) -> bytes:
    """An HTTP/0.9-style request line whose headers never end: no blank line follows."""
    return f"GET /{token}/report.html\r\n".encode()


def handler_threads() -> int:
    return sum(t.is_alive() and "process_request_thread" in t.name for t in threading.enumerate())


@pytest.fixture()
def report(tmp_path) -> Path:
    out = tmp_path / "out"
    StepWriter(out).write(0, None, [], {"psnr": 20.0})
    return out


def test_a_request_is_served_while_many_idle_and_half_sent_connections_are_open(report):
    with serving(report, timeout=60) as server, connections(server.server_address[1], 200) as idle, \
            connections(server.server_address[1], 5) as halves:
        for c in halves:
            c.sendall(half_request(server.token))
        # served before the client gives up, at half the server's timeout: no idle one had to time out
        status, body, _ = get(server, f"/{server.token}/report.html", timeout=30)
        assert status == 200 and body == (report / "report.html").read_bytes()
        assert not select.select(halves, [], [], 0)[0]        # the newest, still waiting for their blank line


def test_idle_and_half_sent_connections_are_closed_after_the_timeout(report):
    timeout = 0.5
    start = time.monotonic()
    with serving(report, timeout=timeout) as server, connections(server.server_address[1], 2) as (idle, half):
        half.sendall(half_request(server.token))
        assert closed_by_server(idle) and closed_by_server(half)        # not the client's 30 s timeout
        assert time.monotonic() - start >= timeout
        assert get(server, f"/{server.token}/report.html")[0] == 200


def test_connections_past_the_bound_close_the_longest_idle_and_threads_stay_bounded(report):
    bound, count = 4, 20
    with serving(report, timeout=60, max_connections=bound) as server, \
            connections(server.server_address[1], 1) as (half,):
        half.sendall(half_request(server.token))                       # the oldest: idle as much as the rest
        with connections(server.server_address[1], count - 1) as rest:
            idle = [half, *rest]
            assert get(server, f"/{server.token}/report.html")[0] == 200
            # room for the request was made by closing the oldest, in their order: the bound less one remain
            kept = bound - 1
            assert all(closed_by_server(c) for c in idle[:count - kept])
            assert not select.select(idle[count - kept:], [], [], 0)[0]
            deadline = time.monotonic() + 30                            # half the server's timeout
            while handler_threads() > bound and time.monotonic() < deadline:
                time.sleep(0.01)
            assert handler_threads() <= bound


def test_the_bound_stays_under_the_descriptor_limit_and_bad_options_are_refused(report, monkeypatch):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for soft, bound in ((100_000, MAX_CONNECTIONS), (1024, MAX_CONNECTIONS), (128, 32), (66, 1), (10, 1),
                        (resource.RLIM_INFINITY, MAX_CONNECTIONS)):
        monkeypatch.setattr(resource, "getrlimit", lambda _, soft=soft: (soft, hard))
        assert connection_bound() == bound, soft
        assert connection_bound(3) == min(3, bound), soft
    monkeypatch.undo()
    for options, match in (({"timeout": 0}, "timeout"), ({"timeout": float("nan")}, "timeout"),
                           ({"timeout": "10"}, "timeout"), ({"max_connections": 0}, "max_connections"),
                           ({"max_connections": 2.5}, "max_connections")):
        with pytest.raises(ValueError, match=match):
            make_server(report, port=0, **options)


class _NoDescriptors:
    """A listening socket whose next ``fails`` accepts fail as when the process has no descriptor left."""

    def __init__(self, listener: socket.socket, fails: int):
        self._listener, self.fails, self.failed_at = listener, fails, []

    def accept(self):
        if len(self.failed_at) < self.fails:
            self.failed_at.append(time.monotonic())
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self._listener.accept()

    def __getattr__(self, name):
        return getattr(self._listener, name)


def test_without_descriptors_the_server_frees_an_idle_connection_and_waits_instead_of_spinning(report):
    with serving(report, timeout=60) as server, connections(server.server_address[1], 1) as (idle,):
        assert get(server, f"/{server.token}/report.html")[0] == 200    # accepted after ``idle``: both are in
        listener = server.socket = _NoDescriptors(server.socket, fails=3)
        assert get(server, f"/{server.token}/report.html")[0] == 200
        assert closed_by_server(idle)
        gaps = [b - a for a, b in zip(listener.failed_at, listener.failed_at[1:])]
        assert len(gaps) == 2 and min(gaps) >= ACCEPT_BACKOFF


def test_insitu_view_prints_a_url_with_a_token_and_survives_bad_requests_and_a_descriptor_limit(tmp_path):
    """Run under ``ulimit -n 128``: twice as many idle connections as descriptors do not keep a request out."""
    out = tmp_path / "out"
    StepWriter(out).write(0, None, [], {"psnr": 20.0})
    limit = 128
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(["sh", "-c", f'ulimit -n {limit} && exec "$0" -m insitu view "$1" --port 0',
                               sys.executable, str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        m = re.search(r"http://localhost:(\d+)/([A-Za-z0-9_-]{24,})/report\.html", line)
        assert m, line
        port, token = int(m.group(1)), m.group(2)

        for target in (f"/{token}/%00", f"/{token}/a%00b/report.html", f"/{token}/\x00report.html", "/\x00",
                       f"/{token}/%ff%fe", "/%", f"/{token}/report.html\x00"):
            assert raw_status(port, target.encode("latin-1")) in (400, 404), target
        with connections(port, 2 * limit) as idle:
            idle[0].sendall(half_request(token))
            assert raw_status(port, f"/{token}/report.html".encode()) == 200
        assert server.poll() is None
    finally:
        server.terminate()
        _, err = server.communicate(timeout=20)
    assert "Traceback" not in err, err
