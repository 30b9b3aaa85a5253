-- idemq schema for SQLite, version 3: the installation's one row, with a
-- check value of the idempotency key hashing in use (docs/idempotency.md).
-- Times are INTEGER microseconds since the Unix epoch (UTC).

CREATE TABLE idemq_installation (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    key_check  TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
