-- One row per (tenant, key): the claim while the upstream call is in flight,
-- then the stored response until the record expires.
CREATE TABLE idempotency_records (
    tenant_id              text        NOT NULL,
    idempotency_key        text        NOT NULL,
    -- SHA-256 of method, path, query and (canonical) body.
    fingerprint            bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- Fences every write: minted anew by each claim and takeover.
    owner_token            uuid        NOT NULL,
    -- 1 for the first claim, +1 for each takeover after an expired lease.
    attempt                integer     NOT NULL CHECK (attempt >= 1),
    state                  text        NOT NULL CHECK (state IN ('in_flight', 'completed')),
    -- In flight: the owner's lease. NULL once completed.
    lease_expires_at       timestamptz,
    created_at             timestamptz NOT NULL,
    completed_at           timestamptz,
    -- Past this (and past the lease, for in-flight rows) the record is
    -- treated as absent and the sweeper deletes it.
    expires_at             timestamptz NOT NULL,
    -- The upstream's response, stored verbatim (end-to-end headers only).
    response_status        smallint,
    response_header_names  text[],
    response_header_values bytea[],
    response_body          bytea,
    -- The body exceeded max_stored_response and was not stored.
    response_body_omitted  boolean     NOT NULL DEFAULT false,
    CHECK (state = 'completed' OR lease_expires_at IS NOT NULL),
    CHECK (state = 'in_flight' OR response_status IS NOT NULL),
    PRIMARY KEY (tenant_id, idempotency_key)
);

-- The sweeper walks expired rows oldest first.
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);

-- Operators list stuck claims by age.
CREATE INDEX idempotency_records_in_flight ON idempotency_records (created_at)
    WHERE state = 'in_flight';
