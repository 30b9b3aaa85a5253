#!/usr/bin/env bash
# Builds the TypeScript client and runs its test suite against a real
# `idemq serve`: once over SQLite, and once more over a fresh PostgreSQL
# database when IDEMQ_TEST_DATABASE_URL is set. Each run ends with one line
#   test result: ok. N passed; M failed; 0 ignored
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$here"

apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then
    apt-get update -qq >/dev/null
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

node_major() { node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }
if ! command -v node >/dev/null || [ "$(node_major)" -lt 20 ] || ! command -v npm >/dev/null; then
  echo "installing Node.js and npm from Debian"
  apt_install nodejs npm
fi
if [ "$(node_major)" -lt 20 ]; then
  echo "error: Node.js >= 20 is needed, found $(node --version 2>/dev/null || echo none)" >&2
  exit 1
fi

export IDEMQ_BIN="${IDEMQ_BIN:-$repo/target/debug/idemq}"
summary_failed() {
  echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
}
if [ ! -x "$IDEMQ_BIN" ]; then
  echo "error: the idemq server binary is missing at $IDEMQ_BIN (build it with cargo, or set IDEMQ_BIN)" >&2
  summary_failed
  exit 1
fi

npm ci --no-audit --no-fund --loglevel=error >/dev/null
npm run --silent build

work="$(mktemp -d)"
pg_db=""
pg_admin=""
cleanup() {
  if [ -n "$pg_db" ]; then
    psql "$pg_admin" -q -v ON_ERROR_STOP=1 -c "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# A snapshot of the binary, so that a rebuild while the suite runs cannot pull it away.
cp "$IDEMQ_BIN" "$work/idemq"
export IDEMQ_BIN="$work/idemq"

overall=0

# The last "# <what> N" line of node's TAP summary (0 when absent).
tap_count() {
  local n
  n=$({ grep -E "^# $1 [0-9]+\$" "$2" || true; } | tail -n 1 | awk '{print $3}')
  echo "${n:-0}"
}

# Runs the suite once; prints node's report and then the one summary line.
run_suite() {
  local label="$1"
  local tap="$work/$label.tap"
  echo "== TypeScript client tests on $label"
  local rc=0
  node --test --test-concurrency=1 \
    --test-reporter=spec --test-reporter-destination=stdout \
    --test-reporter=tap --test-reporter-destination="$tap" \
    build/test/*.test.js || rc=$?
  local pass=0 fail=0 cancelled=0 skipped=0 todo=0
  if [ -f "$tap" ]; then
    pass=$(tap_count pass "$tap")
    fail=$(tap_count fail "$tap")
    cancelled=$(tap_count cancelled "$tap")
    skipped=$(tap_count skipped "$tap")
    todo=$(tap_count todo "$tap")
  fi
  pass=${pass:-0}
  # Cancelled, skipped and todo tests count as failures: nothing here may be left out.
  fail=$(( ${fail:-0} + ${cancelled:-0} + ${skipped:-0} + ${todo:-0} ))
  if [ "$pass" -eq 0 ] && [ "$fail" -eq 0 ]; then
    fail=1 # no report at all: the runner itself failed
  fi
  if [ "$rc" -ne 0 ] && [ "$fail" -eq 0 ]; then
    fail=1
  fi
  if [ "$fail" -eq 0 ]; then
    echo "test result: ok. $pass passed; $fail failed; 0 ignored"
  else
    echo "test result: FAILED. $pass passed; $fail failed; 0 ignored"
    overall=1
  fi
}

run_suite sqlite

if [ -n "${IDEMQ_TEST_DATABASE_URL:-}" ]; then
  if ! command -v psql >/dev/null; then
    echo "installing the PostgreSQL client from Debian"
    apt_install postgresql-client
  fi
  pg_admin="$IDEMQ_TEST_DATABASE_URL"
  name="idemq_ts_$(date +%s)_$$"
  db_url="$(node -e 'const u = new URL(process.argv[1]); u.pathname = "/" + process.argv[2]; console.log(u.href)' "$pg_admin" "$name")"
  echo "== PostgreSQL database $name"
  if psql "$pg_admin" -q -v ON_ERROR_STOP=1 -c "CREATE DATABASE $name" >/dev/null && pg_db="$name" \
    && "$IDEMQ_BIN" migrate --database "$db_url" >/dev/null; then
    IDEMQ_TEST_PG_URL="$db_url" run_suite postgres
  else
    echo "error: could not create and migrate a PostgreSQL database from IDEMQ_TEST_DATABASE_URL" >&2
    summary_failed
    overall=1
  fi
fi

exit "$overall"
