//! Every statement the store sends, with its parameter types.
//!
//! The SQL lives in `sql/*.sql` beside this file, so that it reads as SQL
//! and the benchmark (`bench/run`) compares its pgbench script with the same
//! files the proxy compiles in. Statements that lock several rows order them
//! bytewise (`COLLATE "C"`): a database whose default collation is en_US
//! (managed PostgreSQL's) would otherwise lock a batch of renewals in one
//! order and a batch of completions (sorted in Rust, bytewise) in another,
//! and deadlock.

use tokio_postgres::types::Type;

use super::conn::Sql;

/// The notification channel that carries key changes (completions and
/// releases on waiting routes, operators' releases), named in the SQL files.
pub const CHANNEL: &str = "idemproxy_keys";

/// Claims a new key, or returns the record it already has.
pub(crate) const CLAIM: Sql = Sql {
    text: include_str!("sql/claim.sql"),
    types: &[
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::UUID,
        Type::INT8,
        Type::INT8,
    ],
};

/// [`CLAIM`] for a batch of keys.
pub(crate) const CLAIM_BATCH: Sql = Sql {
    text: include_str!("sql/claim_batch.sql"),
    types: &[
        Type::TEXT_ARRAY,
        Type::TEXT_ARRAY,
        Type::BYTEA_ARRAY,
        Type::UUID_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8_ARRAY,
    ],
};

/// Replaces an owner whose lease ran out.
pub(crate) const TAKE_OVER: Sql = Sql {
    text: include_str!("sql/take_over.sql"),
    types: &[
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::UUID,
        Type::UUID,
        Type::INT8,
    ],
};

/// Replaces a record past its retention with a fresh claim.
pub(crate) const RECLAIM: Sql = Sql {
    text: include_str!("sql/reclaim.sql"),
    types: &[
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::UUID,
        Type::UUID,
        Type::INT8,
        Type::INT8,
    ],
};

/// The parameters of [`COMPLETE`], then those given in the call.
macro_rules! complete_types {
    ($($extra:expr),*) => {
        &[
            Type::TEXT,
            Type::TEXT,
            Type::UUID,
            Type::INT8,
            Type::INT2,
            Type::TEXT_ARRAY,
            Type::BYTEA_ARRAY,
            Type::BYTEA,
            Type::BOOL,
            $($extra),*
        ]
    };
}

/// Stores the response, fenced by the owner token.
pub(crate) const COMPLETE: Sql = Sql {
    text: include_str!("sql/complete.sql"),
    types: complete_types!(),
};

/// [`COMPLETE`] that also notifies the key's id (one more parameter).
pub(crate) const COMPLETE_NOTIFY: Sql = Sql {
    text: include_str!("sql/complete_notify.sql"),
    types: complete_types!(Type::TEXT),
};

/// Renews a batch of leases.
pub(crate) const RENEW_BATCH: Sql = Sql {
    text: include_str!("sql/renew_batch.sql"),
    types: &[
        Type::TEXT_ARRAY,
        Type::TEXT_ARRAY,
        Type::UUID_ARRAY,
        Type::INT8_ARRAY,
    ],
};

/// Deletes our in-flight claim.
pub(crate) const RELEASE: Sql = Sql {
    text: include_str!("sql/release.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::UUID],
};

/// [`RELEASE`] that also notifies the key's id.
pub(crate) const RELEASE_NOTIFY: Sql = Sql {
    text: include_str!("sql/release_notify.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::UUID, Type::TEXT],
};

/// One sweeper batch.
pub(crate) const SWEEP: Sql = Sql {
    text: include_str!("sql/sweep.sql"),
    types: &[Type::INT8, Type::TIMESTAMPTZ],
};

/// Run before [`SWEEP`] in its transaction: the pages a batch dirties are
/// handed to the kernel for writing as they leave shared buffers, not left
/// for it to write all at once some 30 s later (its dirty-page expiry), when
/// every commit of the claims would queue behind that burst. Without it a
/// swept backlog of 1M records stalled claims ~300 ms half a minute after
/// the sweep (docs/retention.md).
pub(crate) const SWEEP_BEGIN: &str = "BEGIN; SET LOCAL backend_flush_after = '256kB'";

/// A record, for operators.
pub(crate) const SHOW: Sql = Sql {
    text: include_str!("sql/show.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::BOOL],
};

/// Records, for operators.
pub(crate) const LIST: Sql = Sql {
    text: include_str!("sql/list.sql"),
    types: &[Type::TEXT, Type::INT8, Type::TEXT, Type::INT8],
};

/// An operator's release.
pub(crate) const FORCE_RELEASE: Sql = Sql {
    text: include_str!("sql/force_release.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::BOOL, Type::TEXT],
};

/// Whether the database is a Citus coordinator: the extension is installed
/// in it. Asked once per store (see `Flavor`).
pub(crate) const IS_CITUS: Sql = Sql {
    text: "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')",
    types: &[],
};

/// [`CLAIM`]'s insert alone (Citus: routed to one shard).
pub(crate) const CLAIM_INSERT: Sql = Sql {
    text: include_str!("sql/claim_insert.sql"),
    types: &[
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::UUID,
        Type::INT8,
        Type::INT8,
    ],
};

/// [`CLAIM`]'s read alone (Citus: routed to one shard).
pub(crate) const CLAIM_READ: Sql = Sql {
    text: include_str!("sql/claim_read.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::BYTEA],
};

/// [`RENEW_BATCH`] for one claim: the single-shard form used on Citus.
pub(crate) const RENEW: Sql = Sql {
    text: include_str!("sql/renew.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::UUID, Type::INT8],
};

/// Whether a record is still ours (Citus: after [`RENEW`]).
pub(crate) const OWNED: Sql = Sql {
    text: include_str!("sql/owned.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::UUID],
};

/// [`FORCE_RELEASE`] without its notification (Citus: see the file).
pub(crate) const FORCE_RELEASE_PLAIN: Sql = Sql {
    text: include_str!("sql/force_release_plain.sql"),
    types: &[Type::TEXT, Type::TEXT, Type::BOOL],
};

/// A key's id on the channel, from the coordinator session (Citus).
pub(crate) const NOTIFY: Sql = Sql {
    text: include_str!("sql/notify.sql"),
    types: &[Type::TEXT],
};

/// [`SWEEP`] in a form Citus runs (no row locks, no ctid).
pub(crate) const SWEEP_CITUS: Sql = Sql {
    text: include_str!("sql/sweep_citus.sql"),
    types: &[Type::INT8, Type::TIMESTAMPTZ],
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts the distinct `$n` placeholders of a statement.
    fn placeholders(text: &str) -> usize {
        let mut max = 0;
        let bytes = text.as_bytes();
        for (i, b) in bytes.iter().enumerate() {
            if *b == b'$' {
                let digits: String = text[i + 1..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let Ok(n) = digits.parse::<usize>() {
                    max = max.max(n);
                }
            }
        }
        max
    }

    #[test]
    fn every_statement_declares_one_type_per_placeholder() {
        for sql in [
            &CLAIM,
            &CLAIM_BATCH,
            &TAKE_OVER,
            &RECLAIM,
            &COMPLETE,
            &COMPLETE_NOTIFY,
            &RENEW_BATCH,
            &RELEASE,
            &RELEASE_NOTIFY,
            &SWEEP,
            &SHOW,
            &LIST,
            &FORCE_RELEASE,
            &IS_CITUS,
            &CLAIM_INSERT,
            &CLAIM_READ,
            &RENEW,
            &OWNED,
            &FORCE_RELEASE_PLAIN,
            &NOTIFY,
            &SWEEP_CITUS,
        ] {
            assert_eq!(placeholders(sql.text), sql.types.len(), "{}", sql.text);
        }
    }

    #[test]
    fn statements_that_lock_several_rows_order_them_bytewise() {
        for sql in [&CLAIM_BATCH, &RENEW_BATCH] {
            assert!(
                sql.text.contains("COLLATE \"C\""),
                "unordered lock in {}",
                sql.text
            );
        }
    }

    #[test]
    fn notifications_go_to_the_one_channel() {
        for sql in [&COMPLETE_NOTIFY, &RELEASE_NOTIFY, &FORCE_RELEASE, &NOTIFY] {
            assert!(
                sql.text.contains(&format!("pg_notify('{CHANNEL}'")),
                "{}",
                sql.text
            );
        }
    }
}

#[cfg(test)]
mod citus_tests {
    use super::*;

    /// The single-shard forms filter by the whole primary key, so that
    /// Citus routes each to the one shard of the key (`tests/citus.rs`
    /// checks the plans on a real cluster).
    #[test]
    fn the_citus_forms_filter_by_the_whole_key_and_never_lock_rows_over_shards() {
        for sql in [&CLAIM_READ, &RENEW, &OWNED, &FORCE_RELEASE_PLAIN] {
            assert!(
                sql.text
                    .contains("WHERE tenant_id = $1 AND idempotency_key = $2"),
                "{}",
                sql.text
            );
        }
        for sql in [
            &CLAIM_INSERT,
            &CLAIM_READ,
            &RENEW,
            &OWNED,
            &FORCE_RELEASE_PLAIN,
        ] {
            let code = code_of(sql.text);
            assert!(!code.contains("WITH "), "{code}");
        }
        for sql in [
            &CLAIM_INSERT,
            &CLAIM_READ,
            &RENEW,
            &OWNED,
            &FORCE_RELEASE_PLAIN,
            &SWEEP_CITUS,
        ] {
            let code = code_of(sql.text);
            for refused in ["FOR UPDATE", "pg_notify", "ctid"] {
                assert!(!code.contains(refused), "{refused} in {code}");
            }
        }
    }

    /// The statement without its comment lines.
    fn code_of(text: &str) -> String {
        text.lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
