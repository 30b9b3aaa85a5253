"""Fixtures: a real `idemq serve` on a free port over a fresh database.

The backend is SQLite unless IDEMQ_CLIENT_TEST_BACKEND=postgres, in which
case a fresh database is created from IDEMQ_TEST_DATABASE_URL, migrated, and
dropped at the end. A server that cannot start or a database that cannot be
reached fails the run; nothing is ever skipped.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

import idemq

REPO_ROOT = Path(__file__).resolve().parents[3]
OPENAPI = REPO_ROOT / "crates" / "idemq-server" / "tests" / "snapshots" / "openapi.json"


def idemq_bin() -> str:
    path = os.environ.get("IDEMQ_BIN") or str(REPO_ROOT / "target" / "debug" / "idemq")
    if not os.access(path, os.X_OK):
        pytest.fail(f"the idemq server binary is missing: {path} (set IDEMQ_BIN)", pytrace=False)
    return path


def backend() -> str:
    return os.environ.get("IDEMQ_CLIENT_TEST_BACKEND", "sqlite")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One `idemq serve` process."""

    def __init__(self, database: str, *, token: Optional[str] = None, port: Optional[int] = None) -> None:
        self.database = database
        self.token = token
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.log = tempfile.NamedTemporaryFile(prefix="idemq-serve-", suffix=".log", delete=False)

    def start(self, timeout: float = 30.0) -> "Server":
        cmd = [idemq_bin(), "serve", "--database", self.database, "--listen", f"127.0.0.1:{self.port}"]
        if self.token:
            cmd += ["--token", self.token]
        env = dict(os.environ)
        env.pop("IDEMQ_TOKEN", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"idemq serve exited with {self.proc.returncode}:\n{self.output()}", pytrace=False)
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"idemq serve did not answer /healthz within {timeout}s:\n{self.output()}", pytrace=False)

    def output(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def _psql(url: str, sql: str) -> None:
    if shutil.which("psql") is None:
        pytest.fail("psql is needed for the PostgreSQL run", pytrace=False)
    res = subprocess.run(["psql", url, "-v", "ON_ERROR_STOP=1", "-qc", sql], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"psql failed ({sql}): {res.stderr.strip()}", pytrace=False)


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if backend() == "sqlite":
        yield "sqlite://" + str(tmp_path_factory.mktemp("idemq") / "idemq.db")
        return
    if backend() != "postgres":
        pytest.fail(f"unknown IDEMQ_CLIENT_TEST_BACKEND {backend()!r}", pytrace=False)
    base = os.environ.get("IDEMQ_TEST_DATABASE_URL")
    if not base:
        pytest.fail("IDEMQ_TEST_DATABASE_URL is needed for the PostgreSQL run", pytrace=False)
    name = "idemq_pyclient_" + uuid.uuid4().hex[:12]
    _psql(base, f"CREATE DATABASE {name}")
    parts = urlsplit(base)
    url = urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))
    try:
        res = subprocess.run([idemq_bin(), "migrate", "--database", url], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.fail(f"idemq migrate failed: {res.stderr.strip()}", pytrace=False)
        yield url
    finally:
        _psql(base, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def server(database_url: str) -> Iterator[Server]:
    srv = Server(database_url).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[idemq.Client]:
    with idemq.Client(server.url) as c:
        yield c


@pytest.fixture
def make_server(database_url: str, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Starts extra servers (own SQLite file; the shared database on PostgreSQL)."""
    started: List[Server] = []

    def make(*, token: Optional[str] = None, port: Optional[int] = None, start: bool = True) -> Server:
        if backend() == "sqlite":
            db = "sqlite://" + str(tmp_path / f"extra-{len(started)}.db")
        else:
            db = database_url
        srv = Server(db, token=token, port=port)
        started.append(srv)
        return srv.start() if start else srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def uniq() -> Callable[[str], str]:
    """Names unique to one test, so tests sharing a server never meet."""
    tag = uuid.uuid4().hex[:10]

    def name(prefix: str) -> str:
        return f"{prefix}-{tag}"

    return name


def run_worker(worker: idemq.Worker) -> threading.Thread:
    t = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    t.start()
    return t


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise AssertionError("condition not met in time")
