//! The pure core: keys, tenants, fingerprints and the state machine.
//!
//! Nothing in here does I/O or reads a clock; the proxy and the store are
//! thin adapters around it.

pub mod decision;
pub mod fingerprint;
pub mod key;
pub mod key_id;
pub mod tenant;

pub use decision::{
    decide, settle, Decision, OwnerToken, RecordState, RecordView, Settlement, UpstreamOutcome,
};
pub use fingerprint::{Fingerprint, FingerprintMode};
pub use key::{IdempotencyKey, KeyError};
pub use key_id::KeyId;
pub use tenant::{TenantError, TenantId};
