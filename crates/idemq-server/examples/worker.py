#!/usr/bin/env python3
"""An idemq worker in Python's standard library, over the HTTP worker protocol.

    IDEMQ_URL=http://127.0.0.1:8080 python3 worker.py [queue ...]

It claims one job at a time (long-polling up to 5 s for work), heartbeats it
every lease/3 from a thread, runs `handle`, and reports `complete` with the
result or `fail` with the error. A `lease-lost` answer means another worker
owns the job now: the result is dropped. Set IDEMQ_TOKEN when the server has
a token, and IDEMQ_EXIT_WHEN_IDLE=1 to stop at the first empty claim.
"""
import json
import os
import sys
import threading
import urllib.error
import urllib.request

BASE = os.environ.get("IDEMQ_URL", "http://127.0.0.1:8080").rstrip("/")
TOKEN = os.environ.get("IDEMQ_TOKEN")
LEASE_MS = 30_000


def call(method, path, body=None):
    """One API call: returns (status, decoded JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    if TOKEN:
        req.add_header("authorization", "Bearer " + TOKEN)
    try:
        with urllib.request.urlopen(req, timeout=70) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def handle(job):
    """The work. Raise to fail the attempt; return a JSON value to complete."""
    if job["type"] == "math.add":
        payload = job["payload"]
        return {"sum": payload["a"] + payload["b"]}
    raise ValueError("no handler for job type " + job["type"])


def heartbeat(job, stop):
    """Renews the lease every lease/3 until `stop` is set or the lease is lost."""
    path = "/v1/jobs/%s/heartbeat" % job["id"]
    while not stop.wait(LEASE_MS / 3000):
        status, _ = call("POST", path, {"lease_token": job["lease_token"]})
        if status == 409:
            return


def run(job):
    stop = threading.Event()
    beat = threading.Thread(target=heartbeat, args=(job, stop), daemon=True)
    beat.start()
    token = {"lease_token": job["lease_token"]}
    try:
        result = handle(job)
        status, body = call("POST", "/v1/jobs/%s/complete" % job["id"], dict(token, result=result))
    except Exception as exc:  # the attempt failed: retried by the job's policy
        status, body = call("POST", "/v1/jobs/%s/fail" % job["id"],
                            dict(token, error=repr(exc), retryable=True))
    finally:
        stop.set()
    print("job %s attempt %s: %s %s" % (job["id"], job["attempt"], status, json.dumps(body)), flush=True)


def main():
    queues = sys.argv[1:] or None
    worker = "python-%d" % os.getpid()
    while True:
        status, body = call("POST", "/v1/claim", {
            "queues": queues, "worker": worker, "limit": 1, "lease_ms": LEASE_MS, "wait_ms": 5000,
        })
        if status != 200:
            print("claim failed: %s %s" % (status, json.dumps(body)), file=sys.stderr, flush=True)
            return 1
        if not body["jobs"] and os.environ.get("IDEMQ_EXIT_WHEN_IDLE"):
            return 0
        for job in body["jobs"]:
            run(job)


if __name__ == "__main__":
    sys.exit(main())
