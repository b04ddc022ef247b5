//! Tenants: the scope a key lives in, taken from a route's tenant header.

use std::fmt;

use sha2::{Digest, Sha256};
use thiserror::Error;

/// Longest tenant value stored as is.
pub const MAX_TENANT_LEN: usize = 255;

/// Prefix of hashed tenants as stored. Plain tenants may not start with it,
/// so the two kinds never share a name: a client cannot reach a hashed
/// tenant's records by sending its digest as a plain tenant.
pub const HASHED_PREFIX: &str = "sha256:";

/// The tenant a record belongs to, as stored: the header value itself, or
/// `sha256:` and the hex SHA-256 of it on `tenant_hash` routes (so a secret
/// such as an `Authorization` value never reaches the database). The empty tenant is
/// used where a route names no tenant header, or it is optional and absent.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct TenantId(String);

/// Why a tenant header was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TenantError {
    /// The route requires a tenant and the header is absent.
    #[error("the tenant header {header} is required on this route")]
    Missing {
        /// The route's tenant header.
        header: String,
    },
    /// The header was sent more than once: which one names the tenant?
    #[error("the tenant header {header} was sent more than once")]
    Repeated {
        /// The route's tenant header.
        header: String,
    },
    /// Not printable ASCII, or too long, on a route that stores it as is.
    #[error("the tenant header {header} must be 1 to {MAX_TENANT_LEN} bytes of visible ASCII, not starting with \"{HASHED_PREFIX}\"")]
    Invalid {
        /// The route's tenant header.
        header: String,
    },
}

impl TenantId {
    /// The empty tenant.
    pub fn none() -> Self {
        TenantId(String::new())
    }

    /// Derives the tenant from the header values found on a keyed request.
    pub fn from_header(
        header: &str,
        values: &[&[u8]],
        required: bool,
        hash: bool,
    ) -> Result<Self, TenantError> {
        match values {
            [] if required => Err(TenantError::Missing {
                header: header.to_owned(),
            }),
            [] => Ok(TenantId::none()),
            [value] if hash => Ok(TenantId::hashed(value)),
            [value] => {
                let ok = !value.is_empty()
                    && value.len() <= MAX_TENANT_LEN
                    && value.iter().all(|b| (0x20..=0x7e).contains(b))
                    && !value.starts_with(HASHED_PREFIX.as_bytes());
                match std::str::from_utf8(value) {
                    Ok(s) if ok => Ok(TenantId(s.to_owned())),
                    _ => Err(TenantError::Invalid {
                        header: header.to_owned(),
                    }),
                }
            }
            _ => Err(TenantError::Repeated {
                header: header.to_owned(),
            }),
        }
    }

    /// The stored form of a `tenant_hash` header value.
    pub fn hashed(value: &[u8]) -> Self {
        TenantId(format!(
            "{HASHED_PREFIX}{}",
            hex::encode(Sha256::digest(value))
        ))
    }

    /// Wraps a tenant as stored (from the database or an operator's flag).
    pub fn from_stored(value: impl Into<String>) -> Self {
        TenantId(value.into())
    }

    /// The stored form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantId({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_optional_tenant_is_the_empty_tenant() {
        assert_eq!(
            TenantId::from_header("X-Tenant", &[], false, false).unwrap(),
            TenantId::none()
        );
    }

    #[test]
    fn absent_required_tenant_is_refused() {
        assert!(matches!(
            TenantId::from_header("X-Tenant", &[], true, false),
            Err(TenantError::Missing { .. })
        ));
    }

    #[test]
    fn repeated_tenant_header_is_refused() {
        assert!(matches!(
            TenantId::from_header("X-Tenant", &[b"a", b"b"], false, false),
            Err(TenantError::Repeated { .. })
        ));
    }

    #[test]
    fn plain_tenant_is_stored_as_sent() {
        assert_eq!(
            TenantId::from_header("X-Tenant", &[b"acme"], true, false)
                .unwrap()
                .as_str(),
            "acme"
        );
    }

    #[test]
    fn hashed_tenant_stores_only_the_sha256_hex() {
        let t = TenantId::from_header("Authorization", &[b"Bearer s3cret"], true, true).unwrap();
        assert_eq!(t.as_str().len(), HASHED_PREFIX.len() + 64);
        assert!(!t.as_str().contains("s3cret"));
        assert_eq!(
            t.as_str(),
            format!("sha256:{}", hex::encode(Sha256::digest(b"Bearer s3cret")))
        );
    }

    #[test]
    fn hashed_tenant_accepts_any_bytes() {
        assert!(TenantId::from_header("Authorization", &[b"\xff\xfe"], true, true).is_ok());
    }

    #[test]
    fn invalid_plain_tenant_is_refused() {
        for bad in [&b"\xff"[..], b"", b"a\x01"] {
            assert!(matches!(
                TenantId::from_header("X-Tenant", &[bad], false, false),
                Err(TenantError::Invalid { .. })
            ));
        }
        // A plain tenant cannot pose as a hashed one.
        let posing = format!("sha256:{}", hex::encode(Sha256::digest(b"x")));
        assert!(TenantId::from_header("X-Tenant", &[posing.as_bytes()], false, false).is_err());
        let long = vec![b'a'; MAX_TENANT_LEN + 1];
        assert!(TenantId::from_header("X-Tenant", &[&long], false, false).is_err());
    }
}
