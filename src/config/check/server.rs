//! `[server]`: the listeners.

use toml::Spanned;

use super::Checker;
use crate::config::raw::RawServer;
use crate::config::{rules, Overrides, ServerConfig};
use crate::tls::TlsFiles;

impl Checker<'_> {
    pub(super) fn server(
        &mut self,
        raw: &RawServer,
        base: Option<&ServerConfig>,
        overrides: &Overrides,
    ) -> Option<ServerConfig> {
        let listen = match overrides.listen {
            Some(addr) => Some(addr),
            None => get!(self, server.listen, raw, base, rules::socket_addr),
        };
        let admin_listen = match overrides.admin_listen {
            Some(addr) => Some(addr),
            None => get!(self, server.admin_listen, raw, base, rules::socket_addr),
        };
        if let (Some(listen), Some(admin)) = (listen, admin_listen) {
            // Port 0 asks for any free port, so two of them do not collide.
            if listen == admin && listen.port() != 0 {
                let span = match overrides.admin_listen {
                    Some(_) => None,
                    None => raw.admin_listen.as_ref().map(Spanned::span),
                };
                self.report(
                    key!(server.admin_listen),
                    span,
                    format!(
                        concat!("must differ from ", key!(server.listen), " (both are {})"),
                        listen
                    ),
                );
            }
        }
        let max_request_body = get!(self, server.max_request_body, raw, base, rules::size);
        let shutdown_grace = get!(self, server.shutdown_grace, raw, base, rules::duration);
        let header_read_timeout = get!(
            self,
            server.header_read_timeout,
            raw,
            base,
            rules::positive_duration
        );
        let max_waiters = get!(self, server.max_waiters, raw, base, |&n| {
            rules::int_in(n, 0..=1_000_000)
                .and_then(|n| usize::try_from(n).map_err(|err| err.to_string()))
        });
        let body_read_timeout = get!(
            self,
            server.body_read_timeout,
            raw,
            base,
            rules::positive_duration
        );
        let max_connections = get!(self, server.max_connections, raw, base, |&n| {
            rules::int_in(n, 1..=1_000_000)
                .and_then(|n| usize::try_from(n).map_err(|err| err.to_string()))
        });
        let h2_max_concurrent_streams =
            get!(self, server.h2_max_concurrent_streams, raw, base, |&n| {
                rules::int_in(n, 1..=10_000)
                    .and_then(|n| u32::try_from(n).map_err(|err| err.to_string()))
            });
        let idle_timeout = get!(
            self,
            server.idle_timeout,
            raw,
            base,
            rules::positive_duration
        );
        let tls = self.listener_tls(raw, base);
        Some(ServerConfig {
            listen: listen?,
            admin_listen: admin_listen?,
            max_request_body: max_request_body?,
            shutdown_grace: shutdown_grace?,
            header_read_timeout: header_read_timeout?,
            tls: tls?,
            max_waiters: max_waiters?,
            body_read_timeout: body_read_timeout?,
            max_connections: max_connections?,
            h2_max_concurrent_streams: h2_max_concurrent_streams?,
            idle_timeout: idle_timeout?,
        })
    }

    /// `server.tls_cert_file` and `server.tls_key_file`: both or neither.
    fn listener_tls(
        &mut self,
        raw: &RawServer,
        base: Option<&ServerConfig>,
    ) -> Option<Option<TlsFiles>> {
        const CERT: &str = key!(server.tls_cert_file);
        const KEY: &str = key!(server.tls_key_file);
        match (&raw.tls_cert_file, &raw.tls_key_file) {
            (None, None) => Some(base.and_then(|b| b.tls.clone())),
            (Some(cert), Some(key)) => {
                let cert_file = self.check(CERT, cert, rules::path);
                let key_file = self.check(KEY, key, rules::path);
                Some(Some(TlsFiles {
                    cert_file: cert_file?,
                    key_file: key_file?,
                }))
            }
            (Some(v), None) => self.bad(
                CERT,
                v,
                concat!(
                    "needs ",
                    key!(server.tls_key_file),
                    " too: a TLS listener needs a certificate and its key"
                ),
            ),
            (None, Some(v)) => self.bad(
                KEY,
                v,
                concat!(
                    "needs ",
                    key!(server.tls_cert_file),
                    " too: a TLS listener needs a certificate and its key"
                ),
            ),
        }
    }
}
