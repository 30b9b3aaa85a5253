#!/usr/bin/env bash
# Runs the Python client's test suite against a real `idemq serve`:
# once over a fresh SQLite database, and once more over a fresh PostgreSQL
# database when IDEMQ_TEST_DATABASE_URL is set. Each run ends with one line
#   test result: ok. N passed; M failed; 0 ignored
# and the script exits non-zero if anything failed.
#
#   IDEMQ_BIN              the server binary (default: <repo>/target/debug/idemq)
#   IDEMQ_PYTHON_VENV      the virtualenv (default: <repo>/target/venv-python-client; reused)
#   IDEMQ_TEST_DATABASE_URL  e.g. postgres://postgres@127.0.0.1:5432/postgres
#   PYTEST_ADDOPTS         extra pytest arguments
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${IDEMQ_PYTHON_VENV:-$root/target/venv-python-client}"
export IDEMQ_BIN="${IDEMQ_BIN:-$root/target/debug/idemq}"

say() { printf '%s\n' "python client: $*" >&2; }
# A setup failure still ends with the one summary line, counting one failure.
die() {
    say "$*"
    echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
    exit 1
}

apt_install() {
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        die "missing $*; install it (Debian: apt-get install $*)"
    fi
    say "installing $* from Debian's packages"
    if [ -z "${_apt_updated:-}" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        _apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Python 3.11+ with venv and pip.
if ! command -v python3 >/dev/null 2>&1; then
    apt_install python3 python3-venv python3-pip
fi
if ! python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    die "python3 is $(python3 --version 2>&1); the client needs Python 3.11 or newer"
fi
if [ -n "${IDEMQ_TEST_DATABASE_URL:-}" ] && ! command -v psql >/dev/null 2>&1; then
    apt_install postgresql-client
fi

if [ ! -x "$IDEMQ_BIN" ]; then
    die "the idemq server binary is missing: $IDEMQ_BIN (build it with cargo build, or set IDEMQ_BIN)"
fi

# The virtualenv, reused when present and working.
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$venv"
    say "creating the virtualenv $venv"
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        # Debian's python3 needs python3-venv (ensurepip) for this.
        rm -rf "$venv"
        apt_install python3-venv python3-pip
        python3 -m venv "$venv" || die "cannot create the virtualenv $venv"
    fi
fi
py="$venv/bin/python"
# The build backend, installed once, so that later runs build the package without a download.
if ! "$py" -c 'import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 61)' >/dev/null 2>&1; then
    "$py" -m pip install -q --disable-pip-version-check --upgrade 'setuptools>=61' wheel >/dev/null ||
        die "cannot install setuptools and wheel into $venv"
fi
# An in-tree build leaves build/ behind; a stale one could ship deleted modules.
rm -rf "$here/build" "$here/src/idemq.egg-info"
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps "$here" >/dev/null ||
    die "cannot install clients/python into $venv"
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation "$here[test]" >/dev/null ||
    die "cannot install clients/python[test] into $venv"

rm -rf "$here/build" "$here/src/idemq.egg-info"

results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
status=0

# One pytest run; prints its one summary line. $1: a label, $2: the backend.
run_suite() {
    local label="$1" backend="$2" xml="$results/$1.xml" rc=0
    say "running the suite on $label"
    (
        cd "$here"
        IDEMQ_CLIENT_TEST_BACKEND="$backend" PYTHONDONTWRITEBYTECODE=1 \
            "$py" -m pytest -p no:cacheprovider -q -rfE --junitxml="$xml" tests
    ) || rc=$?
    "$py" - "$xml" "$rc" <<'PY'
import sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
passed = failed = 0
try:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for s in suites:
        tests, failures = int(s.get("tests", 0)), int(s.get("failures", 0))
        errors, skipped = int(s.get("errors", 0)), int(s.get("skipped", 0))
        passed += tests - failures - errors - skipped
        # Nothing may be skipped: a skip counts as a failure.
        failed += failures + errors + skipped
except (OSError, ET.ParseError):
    failed = max(failed, 1)
if rc != 0 and failed == 0:
    failed = 1  # pytest failed outside any test (collection, no tests, an internal error)
word = "ok" if failed == 0 else "FAILED"
print(f"test result: {word}. {passed} passed; {failed} failed; 0 ignored")
sys.exit(0 if failed == 0 else 1)
PY
}

run_suite sqlite sqlite || status=1
if [ -n "${IDEMQ_TEST_DATABASE_URL:-}" ]; then
    run_suite postgres postgres || status=1
fi
exit "$status"
