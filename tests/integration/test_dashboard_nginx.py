"""Issue 35 item 4: the reverse proxy the docs put in front of an exposed ``pikku dashboard``
(``docs/guide/dashboard-nginx.conf``), run as it is written: Debian's nginx (``./dev
services`` installs it), started unprivileged on free loopback ports with only its ports,
its upstream, its certificate (a self-signed one made here) and its header timeout (1 s
instead of 10 s) changed, proxying to the standalone dashboard served on waitress. A page
loads through it after the token login, a POST passes the dashboard's cross-site check
(the proxy forwards the Host), plain HTTP is redirected, a client trickling header bytes
is cut by nginx's ``client_header_timeout`` however it keeps sending, while others are
served, and the dashboard's cap per address (the proxy's, behind it) reaches the client
as a 503."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pwd
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pikku_celery.dashboard import standalone
from tests.unit.test_contrib import make_pikku
from tests.unit.test_dashboard_slow_clients import TOKEN, serving

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "guide" / "dashboard-nginx.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
HEADER_TIMEOUT_S = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replace_once(text: str, pattern: str, replacement: str) -> str:
    """``text`` with the one line matching ``pattern`` replaced: the example keeps the
    shape this test reads, or the test says which line moved."""
    changed, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    assert count == 1, f"{EXAMPLE.name}: expected one line matching {pattern!r}"
    return changed


def site_config(dashboard_port: int, https_port: int, http_port: int, cert: Path,
                key: Path) -> str:
    """The example config, templated for this machine."""
    text = EXAMPLE.read_text()
    for pattern, replacement in [
            (r"^(\s*)server 127\.0\.0\.1:5580;$", rf"\1server 127.0.0.1:{dashboard_port};"),
            (r"^(\s*)listen 443 ssl;$", rf"\1listen 127.0.0.1:{https_port} ssl;"),
            (r"^(\s*)listen 80;$", rf"\1listen 127.0.0.1:{http_port};"),
            (r"^(\s*)ssl_certificate \S+;$", rf"\1ssl_certificate {cert};"),
            (r"^(\s*)ssl_certificate_key \S+;$", rf"\1ssl_certificate_key {key};"),
            (r"^(\s*)client_header_timeout 10s;$",
             rf"\1client_header_timeout {HEADER_TIMEOUT_S}s;")]:
        text = _replace_once(text, pattern, replacement)
    return text


def main_config(tmp: Path) -> str:
    """What /etc/nginx/nginx.conf gives a conf.d file, every path in ``tmp``."""
    temp_paths = "\n".join(f"    {kind}_temp_path {tmp / kind};"
                           for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"worker_processes 1;\npid {tmp / 'nginx.pid'};\n"
            f"error_log {tmp / 'error.log'} info;\n"
            "events { worker_connections 256; }\n"
            f"http {{\n    access_log {tmp / 'access.log'};\n{temp_paths}\n"
            f"    include {tmp / 'pikku-dashboard.conf'};\n}}\n")


def _as_nobody() -> dict[str, Any]:
    """Popen's arguments running nginx unprivileged (as ``nobody`` when the tests run
    as root; as the tests' own user otherwise)."""
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


@contextlib.contextmanager
def nginx(dashboard_port: int) -> Iterator[tuple[int, int, Path]]:
    """nginx running the example config in front of ``dashboard_port``: its HTTPS port,
    its HTTP port and the certificate it serves. Stopped by its PID on the way out."""
    tmp = Path(tempfile.mkdtemp(prefix="pikku-nginx-"))
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    https_port, http_port = _free_port(), _free_port()
    (tmp / "pikku-dashboard.conf").write_text(
        site_config(dashboard_port, https_port, http_port, cert, key))
    conf = tmp / "nginx.conf"
    conf.write_text(main_config(tmp))
    user = _as_nobody()
    if user:
        for path in [tmp, *tmp.iterdir()]:
            os.chown(path, user["user"], user["group"])
    command = [NGINX, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")]
    checked = subprocess.run([*command, "-t"], capture_output=True, text=True, **user)
    assert checked.returncode == 0, checked.stderr
    proc = subprocess.Popen([*command, "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, **user)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", https_port), timeout=1):
                break
            assert proc.poll() is None, (tmp / "error.log").read_text(errors="replace")
            assert time.monotonic() < deadline, "nginx did not listen within 15 s"
            time.sleep(0.05)
        yield https_port, http_port, cert
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def proxied() -> Iterator[dict[str, Any]]:
    assert os.path.exists(NGINX), "nginx is not installed: ./dev services installs it"
    # As `pikku dashboard --https` serves it: behind TLS, its cookie Secure.
    app = standalone.make_app(make_pikku(), token=TOKEN)
    with serving(app) as server, nginx(server.effective_port) as (https_port, http_port,
                                                                   cert):
        yield {"https_port": https_port, "http_port": http_port, "server": server,
               "tls": ssl.create_default_context(cafile=str(cert))}


def request(proxied: dict[str, Any], method: str, path: str,
            headers: dict[str, str] | None = None, body: bytes | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPSConnection("127.0.0.1", proxied["https_port"], timeout=5,
                                             context=proxied["tls"])
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_a_page_loads_through_nginx(proxied: dict[str, Any]) -> None:
    status, headers, _ = request(proxied, "GET", f"/?token={TOKEN}")
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "Secure" in cookie and "HttpOnly" in cookie
    status, _, page = request(proxied, "GET", "/", {"Cookie": cookie.split(";", 1)[0]})
    assert status == 200 and b"<title>" in page and b"pikku" in page
    status, _, _ = request(proxied, "GET", "/")
    assert status == 401  # nginx lets no one in: the dashboard decides


def test_a_post_through_nginx_passes_the_cross_site_check(proxied: dict[str, Any]) -> None:
    here = f"https://127.0.0.1:{proxied['https_port']}"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    body = json.dumps({"input": {"a": 1, "b": 2}}).encode()
    status, _, answer = request(proxied, "POST", "/api/workflows/sum/runs",
                                {**headers, "Origin": here}, body)
    assert status == 202, answer
    status, _, _ = request(proxied, "POST", "/api/workflows/sum/runs",
                           {**headers, "Origin": "https://elsewhere.example"}, body)
    assert status == 403


def test_plain_http_is_redirected_to_https(proxied: dict[str, Any]) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", proxied["http_port"], timeout=5)
    connection.request("GET", "/runs/x?y=1")
    response = connection.getresponse()
    assert response.status == 301
    assert response.getheader("Location") == "https://127.0.0.1/runs/x?y=1"
    connection.close()


def tls_connect(proxied: dict[str, Any]) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", proxied["https_port"]), timeout=5)
    sock: ssl.SSLSocket = proxied["tls"].wrap_socket(raw, server_hostname="127.0.0.1")
    return sock


def cut(sock: ssl.SSLSocket) -> bool:
    """Whether nginx closed ``sock`` (or answered it, which a partial request is not)."""
    sock.settimeout(0.05)
    try:
        answer = sock.recv(4096)
    except TimeoutError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(5)
    assert not answer.startswith(b"HTTP/1.1 2"), answer
    return True


def test_nginx_cuts_a_trickle_of_header_bytes_and_serves_on(
        proxied: dict[str, Any]) -> None:
    """30 clients trickling header bytes hold none of the dashboard's connections: a
    request is answered at once, and each trickler is cut at nginx's header timeout (1 s
    here), one byte every 0.1 s notwithstanding."""
    tricklers = [tls_connect(proxied) for _ in range(30)]
    for sock in tricklers:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    try:
        started = time.monotonic()
        assert request(proxied, "GET", "/api/runs",
                       {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert time.monotonic() - started < 3
        watched = tricklers[-1]
        while not cut(watched):
            assert time.monotonic() - started < HEADER_TIMEOUT_S + 3.5, (
                "nginx did not cut the trickling client")
            with contextlib.suppress(OSError):
                watched.send(b"x")
            time.sleep(0.1)
        took = time.monotonic() - started
        assert took >= HEADER_TIMEOUT_S - 0.1, f"cut after {took:.1f} s"
        time.sleep(0.5)
        assert all(cut(sock) for sock in tricklers)
    finally:
        for sock in tricklers:
            sock.close()


def test_the_cap_per_address_reaches_the_client_as_a_503(proxied: dict[str, Any]) -> None:
    """Behind nginx every connection comes from 127.0.0.1: with that address's 8
    connections taken, the dashboard refuses the proxy's next one, and nginx passes the
    503 (with its Retry-After) on; once one is free, requests pass again."""
    server = proxied["server"]
    held = [socket.create_connection(("127.0.0.1", server.effective_port), timeout=5)
            for _ in range(standalone.CONNECTIONS_PER_ADDRESS)]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        time.sleep(0.3)  # the dashboard has taken them
        status, headers, _ = request(proxied, "GET", "/api/runs", auth)
        assert status == 503 and headers["Retry-After"] == "5"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while request(proxied, "GET", "/api/runs", auth)[0] != 200:
        assert time.monotonic() < deadline, "the dashboard stayed full"
        time.sleep(0.1)
