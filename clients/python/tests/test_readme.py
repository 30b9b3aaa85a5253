"""The README's examples run as written (against the test server)."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Dict

import idemq
from conftest import Server

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(server: Server, capsys: Any) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 6
    ns: Dict[str, Any] = {"__name__": "readme"}
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop_when_done() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            worker = ns.get("worker")
            if worker is not None and ns["client"].get_job(ns["job_id"]).state == "completed":
                worker.stop()
                return
            time.sleep(0.05)

    try:
        for code in blocks:
            code = code.replace("http://127.0.0.1:8080", server.url)
            stopper = None
            if "worker.run()" in code:
                stopper = threading.Thread(target=stop_when_done, daemon=True)
                stopper.start()
            exec(compile(code, str(README), "exec"), ns)
            if stopper is not None:
                stopper.join(1)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    out = capsys.readouterr().out
    assert "True ['payload']" in out
    assert "idempotency_key default capture…" in out
    assert "'charge_id': 'ch_" in out
    assert "error on type:" in out
    assert "['completed'] 0" in out
    assert isinstance(ns["report"], idemq.WorkerReport) and ns["report"].completed == 1
    assert ns["result"].outcome == "accepted"
