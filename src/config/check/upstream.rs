//! `[upstream]`: the legacy service behind the proxy.

use super::Checker;
use crate::config::raw::RawUpstream;
use crate::config::{rules, UpstreamConfig};

impl Checker<'_> {
    pub(super) fn upstream(
        &mut self,
        raw: &RawUpstream,
        base: Option<&UpstreamConfig>,
    ) -> Option<UpstreamConfig> {
        let url = get!(self, upstream.url, raw, base, rules::upstream_url);
        let connect_timeout = get!(
            self,
            upstream.connect_timeout,
            raw,
            base,
            rules::positive_duration
        );
        let timeout = get!(self, upstream.timeout, raw, base, rules::positive_duration);
        let ca_file = get!(self, upstream.ca_file, raw, optional base, rules::path);
        if let (Some(url), Some(v)) = (&url, &raw.ca_file) {
            if url.scheme() != Some(&http::uri::Scheme::HTTPS) {
                self.report(
                    key!(upstream.ca_file),
                    Some(v.span()),
                    concat!("is only used with an https:// ", key!(upstream.url)),
                );
            }
        }
        Some(UpstreamConfig {
            url: url?,
            connect_timeout: connect_timeout?,
            ca_file: ca_file?,
            timeout: timeout?,
        })
    }
}
