#!/usr/bin/env bash
# Runs the Go client's suite against a real `idemq serve`: once over a fresh
# SQLite database, and once more on PostgreSQL when IDEMQ_TEST_DATABASE_URL
# is set (the suite creates its own database from that URL and drops it).
# Each run ends with one line `test result: ok|FAILED. N passed; M failed; 0 ignored`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$here"

fail_setup() {
	echo "go client: $*" >&2
	echo "test result: FAILED. 0 passed; 1 failed; 0 ignored"
	exit 1
}

as_root() {
	if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else return 1; fi
}

apt_install() {
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 || {
		as_root apt-get update -q >/dev/null 2>&1 &&
			as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
	}
}

# Go from Debian (golang-go, Go 1.19 on bookworm) when it is missing.
if ! command -v go >/dev/null 2>&1; then
	echo "go client: installing golang-go" >&2
	apt_install golang-go || fail_setup "Go is missing and golang-go could not be installed"
fi

export IDEMQ_BIN="${IDEMQ_BIN:-$root/target/debug/idemq}"
[ -x "$IDEMQ_BIN" ] || fail_setup "the idemq server binary $IDEMQ_BIN is missing: build it (cargo build -p idemq-cli) or set IDEMQ_BIN"

# The standard library only; no module proxy.
export GOFLAGS=-mod=mod GOPROXY=off GOTOOLCHAIN=local GOTELEMETRY=off
export GOSUMDB=off
# `go` needs a build cache; without a HOME, keep one in /tmp.
gocache="$(go env GOCACHE 2>/dev/null || true)"
if [ -z "$gocache" ] || [ "$gocache" = off ]; then
	export GOCACHE=/tmp/idemq-go-build-cache
fi

bin="$(mktemp -d)"
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/testreport" ./internal/testreport || fail_setup "cannot build the test reporter"
go vet ./... || fail_setup "go vet failed"

status=0
run_suite() {
	local backend="$1"
	echo "== go client suite on $backend" >&2
	if ! IDEMQ_GO_BACKEND="$backend" go test -count=1 -json -timeout 170s . 2>&1 | "$bin/testreport" "$backend"; then
		status=1
	fi
}

run_suite sqlite
if [ -n "${IDEMQ_TEST_DATABASE_URL:-}" ]; then
	if ! command -v psql >/dev/null 2>&1; then
		apt_install postgresql-client || fail_setup "psql is missing and postgresql-client could not be installed"
	fi
	run_suite postgres
fi
exit "$status"
