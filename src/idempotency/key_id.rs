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

/// A record's address in the store: the tenant and the key, which together
/// scope every record (two tenants may use the same key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    /// The tenant as stored (hashed on `tenant_hash` routes).
    pub tenant: TenantId,
    /// The idempotency key.
    pub key: IdempotencyKey,
}

impl RecordKey {
    /// The record of `key` for `tenant`.
    pub fn new(tenant: TenantId, key: IdempotencyKey) -> Self {
        RecordKey { tenant, key }
    }

    /// Its digest.
    pub fn id(&self) -> KeyId {
        KeyId::new(&self.tenant, &self.key)
    }

    /// The readable derived key (`derived_key = "tenant_key"`): the tenant
    /// with `%` and `:` percent-encoded (`%25`, `%3A`), a `:`, then the key
    /// as it is.
    ///
    /// Why this form: the encoded tenant holds no `:`, so the first `:`
    /// ends it and an upstream reads both parts back (split at the first
    /// `:`, percent-decode the tenant); two different pairs therefore never
    /// derive the same value. `a:b` + `c` gives `a%3Ab:c`, `a` + `b:c`
    /// gives `a:b:c`. A tenant without `%` or `:` is written as it is, so
    /// the value is the plain `tenant:key` it always was for those;
    /// hashed tenants (`sha256:…`) do change form.
    pub fn tenant_key(&self) -> String {
        let tenant = self.tenant.as_str();
        let mut out = String::with_capacity(tenant.len() + 1 + self.key.as_str().len());
        for c in tenant.chars() {
            match c {
                '%' => out.push_str("%25"),
                ':' => out.push_str("%3A"),
                c => out.push(c),
            }
        }
        out.push(':');
        out.push_str(self.key.as_str());
        out
    }
}

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

    /// The channel form (see `Display`) without allocating: a cache
    /// lookup needs it on every keyed request.
    pub fn channel(&self) -> ChannelForm {
        let mut hex = [0u8; 32];
        // 16 bytes always fit 32 hex digits.
        let _ = hex::encode_to_slice(&self.0[..16], &mut hex);
        ChannelForm(hex)
    }
}

/// A key id's channel form, on the stack.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ChannelForm([u8; 32]);

impl ChannelForm {
    /// The 32 lowercase hex digits.
    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// The channel form: hex of the first 16 bytes (32 characters), what a
/// notification carries and the cache is keyed by.
impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.channel().as_str())
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
        // The channel form is the first half of the hex digest.
        assert_eq!(a.channel().as_str(), &a.hex()[..32]);
        assert_eq!(a.to_string(), a.channel().as_str());
        // The boundary itself: the same bytes split at another place (the
        // separator is what tells them apart).
        assert_ne!(KeyId::of_stored("a", "bc"), KeyId::of_stored("ab", "c"));
        assert_ne!(KeyId::of_stored("", "ab"), KeyId::of_stored("ab", ""));
    }

    fn rk(tenant: &str, key: &str) -> RecordKey {
        RecordKey::new(TenantId::from_stored(tenant), k(key))
    }

    #[test]
    fn tenant_key_form_keeps_a_colon_in_the_tenant_apart_from_the_separator() {
        assert_ne!(rk("a:b", "c").tenant_key(), rk("a", "b:c").tenant_key());
        assert_ne!(rk("a%", "b").tenant_key(), rk("a", "%b").tenant_key());
        assert_ne!(
            rk("a%3Ab", "c").tenant_key(),
            rk("a:b", "c").tenant_key(),
            "an escape sequence in a tenant is escaped itself"
        );
    }

    #[test]
    fn tenant_key_form_is_unchanged_for_tenants_without_colon_or_percent() {
        assert_eq!(rk("acme", "o-1").tenant_key(), "acme:o-1");
        assert_eq!(rk("acme corp", "a:b%c").tenant_key(), "acme corp:a:b%c");
        assert_eq!(rk("", "k").tenant_key(), ":k");
    }

    /// What an upstream does with the value: split at the first `:`,
    /// percent-decode the tenant.
    fn read_back(derived: &str) -> (String, String) {
        let (tenant, key) = derived.split_once(':').expect("a separator");
        let tenant = tenant.replace("%3A", ":").replace("%25", "%");
        (tenant, key.to_owned())
    }

    proptest::proptest! {
        /// The pair can be read back from the value, so two different pairs
        /// never derive the same one. The alphabet is small and full of
        /// separators and escapes, so near misses are the common case.
        #[test]
        fn tenant_key_form_reads_back_to_its_pair(
            tenant in "[a:%3A ]{0,8}", key in "[a:%3A]{1,8}",
        ) {
            let derived = rk(&tenant, &key).tenant_key();
            proptest::prop_assert_eq!(read_back(&derived), (tenant, key));
        }

        #[test]
        fn tenant_key_form_never_collides(
            t1 in "[a:%3A]{0,6}", k1 in "[a:%3A]{1,6}",
            t2 in "[a:%3A]{0,6}", k2 in "[a:%3A]{1,6}",
        ) {
            let (a, b) = (rk(&t1, &k1), rk(&t2, &k2));
            if a != b {
                proptest::prop_assert_ne!(a.tenant_key(), b.tenant_key());
            }
        }
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
