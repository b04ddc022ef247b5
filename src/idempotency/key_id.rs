//! The one digest of a `(tenant, key)` pair.
//!
//! Several places name a key without carrying it in clear: the notification
//! channel (a fixed-size payload, nothing of a tenant in clear), the response
//! cache (by the id a notification names) and the derived downstream key
//! (`derived_key = "sha256"`). They all use this digest:
//! SHA-256(tenant ‖ 0x00 ‖ key). Neither part can contain a NUL byte
//! (header values cannot), so two different pairs never hash the same
//! input.

use std::fmt;

use sha2::{Digest, Sha256};

use super::{IdempotencyKey, TenantId};

/// SHA-256 of a tenant and a key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; 32]);

impl KeyId {
    /// The id of a request's tenant and key.
    pub fn new(tenant: &TenantId, key: &IdempotencyKey) -> Self {
        Self::of_stored(tenant.as_str(), key.as_str())
    }

    /// The id of a tenant and key as stored (operators' tools).
    pub fn of_stored(tenant: &str, key: &str) -> Self {
        let mut h = Sha256::new();
        h.update(tenant.as_bytes());
        h.update([0]);
        h.update(key.as_bytes());
        KeyId(h.finalize().into())
    }

    /// The whole digest as hex (64 characters): the derived downstream key.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

/// The channel form: hex of the first 16 bytes (32 characters), what a
/// notification carries and the cache is keyed by.
impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0[..16]))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s.as_bytes(), 255).unwrap()
    }

    #[test]
    fn ids_separate_tenants_and_keys() {
        let a = KeyId::new(&TenantId::from_stored("a"), &k("b"));
        assert_ne!(a, KeyId::new(&TenantId::from_stored("ab"), &k("x")));
        assert_ne!(a, KeyId::new(&TenantId::from_stored("b"), &k("b")));
        assert_ne!(a, KeyId::new(&TenantId::from_stored("a:b"), &k("c")));
        assert_eq!(a, KeyId::of_stored("a", "b"));
    }

    #[test]
    fn channel_form_is_32_hex_digits_and_a_prefix_of_the_whole() {
        let id = KeyId::of_stored("tenant", "key");
        let channel = id.to_string();
        assert_eq!(channel.len(), 32);
        assert_eq!(id.hex().len(), 64);
        assert!(id.hex().starts_with(&channel));
        // The digest itself: SHA-256 of "tenant\0key".
        assert_eq!(id.hex(), hex::encode(Sha256::digest(b"tenant\0key")));
    }
}
