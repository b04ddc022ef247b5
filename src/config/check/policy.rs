//! The idempotency policy: `[defaults]`, and each route's overrides of it.

use super::Checker;
use crate::config::raw::RawPolicy;
use crate::config::{rules, DerivedKey, KeyRequirement, Policy};
use crate::idempotency::fingerprint::FingerprintMode;

impl Checker<'_> {
    /// The policy at `at` (`defaults` or `route[i]`), layered over `base`.
    pub(super) fn policy(
        &mut self,
        at: &str,
        raw: &RawPolicy,
        base: Option<&Policy>,
    ) -> Option<Policy> {
        let key_header = get!(self, [at].key_header, raw, base, rules::header_name);
        let methods = get!(self, [at].methods, raw, base, each rules::method);
        let requirement = get!(self, [at].key, raw, base, |v| {
            rules::choice(
                v,
                &[
                    ("optional", KeyRequirement::Optional),
                    ("required", KeyRequirement::Required),
                ],
            )
        });
        let lease = get!(self, [at].lease, raw, base, rules::lease);
        let retention = get!(self, [at].retention, raw, base, rules::positive_duration);
        // Checked where either is set; an inherited pair was checked where it
        // was set.
        if let (Some(lease), Some(retention)) = (lease, retention) {
            if lease >= retention {
                let set_here = [named!(raw.lease), named!(raw.retention)]
                    .into_iter()
                    .find_map(|(name, v)| v.as_ref().map(|v| (name, v.span())));
                if let Some((name, span)) = set_here {
                    self.report(
                        &format!("{at}.{name}"),
                        Some(span),
                        format!(
                            "lease ({}) must be shorter than retention ({}): a record must outlive its claim",
                            humantime::format_duration(lease),
                            humantime::format_duration(retention)
                        ),
                    );
                }
            }
        }
        let max_key_length = get!(self, [at].max_key_length, raw, base, |&n| {
            rules::int_in(n, 1..=1024)
                .and_then(|n| usize::try_from(n).map_err(|err| err.to_string()))
        });
        let fingerprint = get!(self, [at].fingerprint, raw, base, |v| {
            rules::choice(
                v,
                &[
                    ("json", FingerprintMode::Json),
                    ("bytes", FingerprintMode::Bytes),
                ],
            )
        });
        let release_on = get!(
            self,
            [at].release_on,
            raw,
            base,
            each | &n | rules::status(n)
        );
        let max_stored_response = get!(self, [at].max_stored_response, raw, base, rules::size);
        let wait = get!(self, [at].wait, raw, base, rules::duration);
        let derived_key_header = get!(self, [at].derived_key_header, raw, base, |v| {
            if v.is_empty() {
                Ok(None)
            } else {
                rules::header_name(v).map(Some)
            }
        });
        let derived_key = get!(self, [at].derived_key, raw, base, |v| {
            rules::choice(
                v,
                &[
                    ("sha256", DerivedKey::Sha256),
                    ("tenant_key", DerivedKey::TenantKey),
                ],
            )
        });
        Some(Policy {
            derived_key_header: derived_key_header?,
            derived_key: derived_key?,
            key_header: key_header?,
            methods: methods?,
            key: requirement?,
            lease: lease?,
            retention: retention?,
            max_key_length: max_key_length?,
            fingerprint: fingerprint?,
            release_on: release_on?,
            max_stored_response: max_stored_response?,
            wait: wait?,
        })
    }
}
