//! The state machine of DESIGN.md §1, as a pure function.
//!
//! The store reads a key's record (or finds none and claims it); everything
//! else is decided here from what was read, the request's fingerprint and
//! the database's clock — no I/O, no ambient time.

use std::time::{Duration, SystemTime};

use uuid::Uuid;

use super::fingerprint::Fingerprint;

/// The token that names one attempt's ownership of a key. Minted fresh for
/// every claim and takeover; completion, renewal and release are fenced by
/// it, so a stale attempt can never overwrite its successor's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(Uuid);

impl OwnerToken {
    /// A new random token (a version-4 UUID), its bits drawn from the
    /// kernel (`getrandom`) for every token. A thread-local generator
    /// would save that system call per claim (BENCHMARKS.md, eighteenth
    /// pass) but not stay unique: clones of one VM snapshot, restored side
    /// by side, would mint the same tokens in the same order until it
    /// reseeds, and a token fences attempts of the same key. Linux
    /// reseeds its own generator when the hypervisor reports a clone (VM
    /// generation ID, Linux 5.18 and later).
    pub fn mint() -> Self {
        OwnerToken(Uuid::new_v4())
    }
    /// Wraps a token read from the store.
    pub fn from_uuid(id: Uuid) -> Self {
        OwnerToken(id)
    }
    /// The token as a UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

/// The two stored states of a record (absent is the third).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Owned by one attempt until `lease_expires_at`.
    InFlight {
        /// When the owner's lease runs out unless renewed.
        lease_expires_at: SystemTime,
    },
    /// The upstream answered and the answer is stored.
    Completed,
}

/// What the store holds for a key, as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordView {
    /// Fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The current owner.
    pub owner: OwnerToken,
    /// Attempt number of the current owner (1 for the first claim).
    pub attempt: i32,
    /// In flight or completed.
    pub state: RecordState,
    /// When the record stops being remembered (retention).
    pub expires_at: SystemTime,
}

impl RecordView {
    /// A record past its retention is treated as absent. An in-flight
    /// record is only past retention once its lease has run out too.
    pub fn is_expired(&self, now: SystemTime) -> bool {
        let past_retention = self.expires_at <= now;
        match self.state {
            RecordState::Completed => past_retention,
            RecordState::InFlight { lease_expires_at } => past_retention && lease_expires_at <= now,
        }
    }
}

/// What to do with a request whose key already has a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Completed, same request: replay the stored response.
    Replay,
    /// In flight under a valid lease, same request: 409 (or wait).
    Conflict {
        /// How long until the current lease runs out.
        lease_remaining: Duration,
    },
    /// A different request reuses the key: 422.
    Mismatch,
    /// In flight but the lease ran out: take over with a new owner token.
    TakeOver {
        /// The owner being fenced out.
        previous: OwnerToken,
        /// The attempt number the new owner gets.
        attempt: i32,
    },
    /// Past retention: treat as absent and claim afresh (attempt 1).
    Reclaim {
        /// The owner of the expired record, to fence the replacement.
        previous: OwnerToken,
    },
}

/// Decides what a request with `fingerprint` gets, given the record found.
pub fn decide(record: &RecordView, fingerprint: &Fingerprint, now: SystemTime) -> Decision {
    if record.is_expired(now) {
        return Decision::Reclaim {
            previous: record.owner,
        };
    }
    if record.fingerprint != *fingerprint {
        return Decision::Mismatch;
    }
    match record.state {
        RecordState::Completed => Decision::Replay,
        RecordState::InFlight { lease_expires_at } => match lease_expires_at.duration_since(now) {
            Ok(remaining) if !remaining.is_zero() => Decision::Conflict {
                lease_remaining: remaining,
            },
            _ => Decision::TakeOver {
                previous: record.owner,
                attempt: record.attempt.saturating_add(1),
            },
        },
    }
}

/// `Retry-After` seconds for a 409: the remaining lease, rounded up, at
/// least one second (the header has whole-second resolution).
pub fn retry_after_secs(lease_remaining: Duration) -> u64 {
    let secs = lease_remaining.as_secs() + u64::from(lease_remaining.subsec_nanos() > 0);
    secs.max(1)
}

/// How the upstream exchange of an owned claim ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamOutcome {
    /// The upstream answered with this status.
    Answered(u16),
    /// The connection was never established: the request provably never
    /// reached the upstream.
    NotSent,
    /// Sent, then the connection failed or timed out: the outcome is unknown.
    Unknown,
}

/// What happens to an owned claim once the upstream call ends (§2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Store the response and complete the record.
    Complete,
    /// Delete the claim: nothing happened (or the upstream asked for a
    /// retry), so a retry may execute.
    Release,
    /// Leave the claim in flight, unrenewed, until its lease expires: the
    /// request may have executed and nobody can tell.
    KeepInFlight,
}

/// Settles a claim from the upstream outcome and the route's `release_on`.
pub fn settle(outcome: UpstreamOutcome, release_on: &[u16]) -> Settlement {
    match outcome {
        UpstreamOutcome::Answered(status) if release_on.contains(&status) => Settlement::Release,
        UpstreamOutcome::Answered(_) => Settlement::Complete,
        UpstreamOutcome::NotSent => Settlement::Release,
        UpstreamOutcome::Unknown => Settlement::KeepInFlight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    fn fp(n: u8) -> Fingerprint {
        Fingerprint::from_bytes(&[n; 32]).unwrap()
    }

    fn record(state: RecordState) -> RecordView {
        RecordView {
            fingerprint: fp(1),
            owner: OwnerToken::from_uuid(Uuid::from_u128(7)),
            attempt: 1,
            state,
            expires_at: t(86_400),
        }
    }

    const NOW: u64 = 100;

    // DESIGN.md §1, row "in flight, lease valid".
    #[test]
    fn in_flight_valid_lease_same_fingerprint_conflicts_with_remaining_lease() {
        let r = record(RecordState::InFlight {
            lease_expires_at: t(NOW + 7),
        });
        assert_eq!(
            decide(&r, &fp(1), t(NOW)),
            Decision::Conflict {
                lease_remaining: Duration::from_secs(7)
            }
        );
    }

    #[test]
    fn in_flight_valid_lease_different_fingerprint_is_a_mismatch() {
        let r = record(RecordState::InFlight {
            lease_expires_at: t(NOW + 7),
        });
        assert_eq!(decide(&r, &fp(2), t(NOW)), Decision::Mismatch);
    }

    // Row "in flight, lease expired".
    #[test]
    fn in_flight_expired_lease_same_fingerprint_takes_over_with_next_attempt() {
        let r = record(RecordState::InFlight {
            lease_expires_at: t(NOW - 1),
        });
        assert_eq!(
            decide(&r, &fp(1), t(NOW)),
            Decision::TakeOver {
                previous: r.owner,
                attempt: 2
            }
        );
    }

    #[test]
    fn lease_ending_exactly_now_counts_as_expired() {
        let r = record(RecordState::InFlight {
            lease_expires_at: t(NOW),
        });
        assert!(matches!(
            decide(&r, &fp(1), t(NOW)),
            Decision::TakeOver { .. }
        ));
    }

    #[test]
    fn in_flight_expired_lease_different_fingerprint_is_a_mismatch() {
        let r = record(RecordState::InFlight {
            lease_expires_at: t(NOW - 1),
        });
        assert_eq!(decide(&r, &fp(2), t(NOW)), Decision::Mismatch);
    }

    // Row "completed".
    #[test]
    fn completed_same_fingerprint_replays() {
        assert_eq!(
            decide(&record(RecordState::Completed), &fp(1), t(NOW)),
            Decision::Replay
        );
    }

    #[test]
    fn completed_different_fingerprint_is_a_mismatch() {
        assert_eq!(
            decide(&record(RecordState::Completed), &fp(2), t(NOW)),
            Decision::Mismatch
        );
    }

    // Row "absent (or expired past retention)".
    #[test]
    fn completed_past_retention_is_reclaimed_whatever_the_fingerprint() {
        let mut r = record(RecordState::Completed);
        r.expires_at = t(NOW - 1);
        for f in [fp(1), fp(2)] {
            assert_eq!(
                decide(&r, &f, t(NOW)),
                Decision::Reclaim { previous: r.owner }
            );
        }
    }

    #[test]
    fn in_flight_past_retention_with_valid_lease_is_not_reclaimed() {
        let mut r = record(RecordState::InFlight {
            lease_expires_at: t(NOW + 5),
        });
        r.expires_at = t(NOW - 1);
        assert!(matches!(
            decide(&r, &fp(1), t(NOW)),
            Decision::Conflict { .. }
        ));
        assert_eq!(decide(&r, &fp(2), t(NOW)), Decision::Mismatch);
    }

    #[test]
    fn in_flight_past_retention_and_lease_is_reclaimed() {
        let mut r = record(RecordState::InFlight {
            lease_expires_at: t(NOW - 5),
        });
        r.expires_at = t(NOW - 1);
        assert_eq!(
            decide(&r, &fp(2), t(NOW)),
            Decision::Reclaim { previous: r.owner }
        );
    }

    #[test]
    fn attempt_numbers_count_takeovers() {
        let mut r = record(RecordState::InFlight {
            lease_expires_at: t(NOW - 1),
        });
        r.attempt = 4;
        assert!(matches!(
            decide(&r, &fp(1), t(NOW)),
            Decision::TakeOver { attempt: 5, .. }
        ));
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_and_is_at_least_one() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(2500)), 3);
        assert_eq!(retry_after_secs(Duration::from_secs(10)), 10);
    }

    // DESIGN.md §2, the upstream rows.
    #[test]
    fn upstream_refused_connection_releases_the_claim() {
        assert_eq!(settle(UpstreamOutcome::NotSent, &[]), Settlement::Release);
    }

    #[test]
    fn upstream_unknown_outcome_keeps_the_claim_in_flight() {
        assert_eq!(
            settle(UpstreamOutcome::Unknown, &[503]),
            Settlement::KeepInFlight
        );
    }

    #[test]
    fn release_on_status_releases_the_claim() {
        assert_eq!(
            settle(UpstreamOutcome::Answered(429), &[429, 503]),
            Settlement::Release
        );
        assert_eq!(
            settle(UpstreamOutcome::Answered(503), &[429, 503]),
            Settlement::Release
        );
    }

    #[test]
    fn any_other_answer_including_5xx_is_stored() {
        for s in [200, 201, 204, 400, 404, 409, 500, 502, 503] {
            assert_eq!(
                settle(UpstreamOutcome::Answered(s), &[429]),
                Settlement::Complete,
                "{s}"
            );
        }
    }
}
