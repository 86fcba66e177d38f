"""``insitu view``'s server (insitu.report.make_server): the report's own files, under a random token,
and nothing else: not what symbolic links lead to outside the folder, no listings, no dotfiles or
temporary folders, no other file of the folder, whatever the encoding of the path."""
import http.client
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from insitu.export import StepWriter
from insitu.report import make_server, served_name

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
    server = make_server(out, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield out, server, secret
    finally:
        server.shutdown()
        server.server_close()


def get(server, path: str, method: str = "GET") -> tuple[int, bytes, dict]:
    """``method path`` exactly as given (no client-side normalisation): (status, body, headers)."""
    c = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
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


def test_insitu_view_prints_a_url_with_a_token_and_survives_bad_requests(tmp_path):
    out = tmp_path / "out"
    StepWriter(out).write(0, None, [], {"psnr": 20.0})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "insitu", "view", str(out), "--port", "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        m = re.search(r"http://localhost:(\d+)/([A-Za-z0-9_-]{24,})/report\.html", line)
        assert m, line
        port, token = int(m.group(1)), m.group(2)

        for target in (f"/{token}/%00", f"/{token}/a%00b/report.html", f"/{token}/\x00report.html", "/\x00",
                       f"/{token}/%ff%fe", "/%", f"/{token}/report.html\x00"):
            assert raw_status(port, target.encode("latin-1")) in (400, 404), target
        assert raw_status(port, f"/{token}/report.html".encode()) == 200
    finally:
        server.terminate()
        _, err = server.communicate(timeout=20)
    assert "Traceback" not in err, err
