//! New connections to the upstream: TCP (bounded by
//! `upstream.connect_timeout`, no Nagle), TLS for `https://`, then an
//! HTTP/1.1 handshake whose connection is driven by a task of its own.
//!
//! Every failure here happens before a request byte is written, so each is
//! an [`UpstreamError::Connect`], or [`UpstreamError::Certificate`] when
//! TLS refused the upstream.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tracing::debug;

use super::{error_chain, is_tls_failure, UpstreamError};
use crate::proxy::ProxyBody;

/// How to reach the upstream.
pub(super) struct Connector {
    /// The host as resolved: a name, or an IP address without brackets.
    host: String,
    /// The port, explicit or the scheme's.
    port: u16,
    /// `https://` upstreams: the verifying TLS client and the name sent as
    /// SNI and checked against the certificate.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    /// The bound on making the TCP connection (split across the addresses a
    /// name resolves to, as hyper-util's connector did).
    connect_timeout: Duration,
}

impl Connector {
    /// `tls` is the client configuration for an `https://` upstream; `None`
    /// for `http://`.
    pub(super) fn new(
        host: &str,
        port: u16,
        tls: Option<rustls::ClientConfig>,
        connect_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let tls = match tls {
            None => None,
            Some(mut config) => {
                // HTTP/1.1 only, as before (hyper-rustls's enable_http1).
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                let name = ServerName::try_from(host.clone()).map_err(|e| {
                    anyhow::anyhow!("upstream.url: {host:?} is not a TLS server name: {e}")
                })?;
                Some((TlsConnector::from(Arc::new(config)), name))
            }
        };
        Ok(Connector {
            host,
            port,
            tls,
            connect_timeout,
        })
    }

    /// A new connection, ready for its first request.
    pub(super) async fn connect(&self) -> Result<SendRequest<ProxyBody>, UpstreamError> {
        let tcp = self.tcp().await?;
        match &self.tls {
            None => handshake(tcp).await,
            Some((tls, name)) => {
                let stream = tls.connect(name.clone(), tcp).await.map_err(|e| {
                    if is_tls_failure(&e) {
                        UpstreamError::Certificate(error_chain(&e))
                    } else {
                        UpstreamError::Connect(format!("TLS handshake: {}", error_chain(&e)))
                    }
                })?;
                handshake(stream).await
            }
        }
    }

    /// A TCP connection to the first address that takes one.
    async fn tcp(&self) -> Result<TcpStream, UpstreamError> {
        let addrs: Vec<SocketAddr> = match self.host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, self.port)],
            Err(_) => tokio::net::lookup_host((self.host.as_str(), self.port))
                .await
                .map_err(|e| UpstreamError::Connect(format!("resolving {}: {e}", self.host)))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(UpstreamError::Connect(format!(
                "resolving {}: no addresses",
                self.host
            )));
        }
        let each = self.connect_timeout / addrs.len() as u32;
        let mut last = String::new();
        for addr in addrs {
            match tokio::time::timeout(each, TcpStream::connect(addr)).await {
                Ok(Ok(tcp)) => {
                    // Best effort: a socket that refuses it still works.
                    let _ = tcp.set_nodelay(true);
                    return Ok(tcp);
                }
                Ok(Err(e)) => last = format!("tcp connect to {addr}: {e}"),
                Err(_) => last = format!("tcp connect to {addr}: timed out after {each:?}"),
            }
        }
        Err(UpstreamError::Connect(last))
    }
}

/// The HTTP/1.1 handshake (no I/O: it only sets the connection up), and
/// the task that drives the connection until either side closes it.
async fn handshake<T>(io: T) -> Result<SendRequest<ProxyBody>, UpstreamError>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = http1::Builder::new()
        // One buffer per request, as for the server's responses
        // (src/server.rs).
        .writev(false)
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| UpstreamError::Connect(error_chain(&e)))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!(error = %error_chain(&e), "upstream connection ended with an error");
        }
    });
    Ok(sender)
}
