//! `[store]`: the PostgreSQL that holds the records.

use super::Checker;
use crate::config::raw::RawStore;
use crate::config::{rules, OnStoreError, Overrides, Secret, StoreConfig};

impl Checker<'_> {
    pub(super) fn store(
        &mut self,
        raw: &RawStore,
        base: Option<&StoreConfig>,
        overrides: &Overrides,
    ) -> Option<StoreConfig> {
        // The URLs are secrets: their rules' messages never echo them.
        let database_url = match &overrides.database_url {
            Some(url) => match rules::database_url(url.expose()) {
                Ok(()) => Some(url.clone()),
                Err(message) => {
                    // Named after the flag (see `Overrides::origins`).
                    self.report(key!(store.database_url), None, message);
                    None
                }
            },
            None => get!(self, store.database_url, raw, base, |url| {
                rules::database_url(url).map(|()| Secret::new(url))
            }),
        };
        let pool_size = get!(self, store.pool_size, raw, base, |&n| {
            if n < 3 {
                return Err(format!(
                    "must be at least 3, not {n}: the claim and completion batch workers hold one connection each, and lease renewals need one they can always get"
                ));
            }
            usize::try_from(n).map_err(|err| err.to_string())
        });
        let timeout = get!(self, store.timeout, raw, base, rules::positive_duration);
        let on_store_error = get!(self, store.on_store_error, raw, base, |v| {
            rules::choice(
                v,
                &[
                    ("reject", OnStoreError::Reject),
                    ("pass_through", OnStoreError::PassThrough),
                ],
            )
        });
        let ca_file = get!(self, store.ca_file, raw, optional base, rules::path);
        let response_cache = get!(self, store.response_cache, raw, base, rules::size);
        let response_cache_ttl = get!(
            self,
            store.response_cache_ttl,
            raw,
            base,
            rules::positive_duration
        );
        let prepared_statements = get!(self, store.prepared_statements, raw, base, rules::flag);
        let listen_url = get!(self, store.listen_url, raw, optional base, |url| {
            rules::database_url(url).map(|()| Secret::new(url))
        });
        Some(StoreConfig {
            prepared_statements: prepared_statements?,
            listen_url: listen_url?,
            response_cache: response_cache?,
            response_cache_ttl: response_cache_ttl?,
            database_url: database_url?,
            pool_size: pool_size?,
            timeout: timeout?,
            on_store_error: on_store_error?,
            ca_file: ca_file?,
        })
    }
}
