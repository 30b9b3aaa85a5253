-- idemq schema for PostgreSQL, version 5: the installation's one row. It
-- records a check value of the idempotency key hashing in use (plain
-- SHA-256, or HMAC-SHA-256 with the installation secret), written by the
-- first process that connects; a process whose hashing differs is refused
-- at connect, because it would hash a repeated key to another binding and
-- accept the same work twice (docs/idempotency.md).

CREATE TABLE idemq.installation (
    id         boolean     PRIMARY KEY DEFAULT true CHECK (id),
    key_check  text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
