//! The upstream client: pooled keep-alive connections, bounded connect and
//! exchange times, and errors sorted by what they prove.
//!
//! An `https://` upstream is verified (chain and host name) against the
//! system trust store plus `upstream.ca_file` (see [`crate::tls`]). A
//! certificate that does not verify fails the connection before any request
//! byte is written, so it is a [`UpstreamError::Connect`]: the claim is
//! released and the client gets 502.

use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use thiserror::Error;

use super::ProxyBody;
use crate::config::UpstreamConfig;
use crate::idempotency::UpstreamOutcome;

/// Why an upstream exchange produced no response.
#[derive(Debug, Error)]
pub enum UpstreamError {
    /// No connection could be made: the request provably never left.
    #[error("could not connect to the upstream: {0}")]
    Connect(String),
    /// The upstream's TLS certificate did not verify: the connection was
    /// refused before a request byte was written.
    #[error("the upstream's certificate did not verify: {0}")]
    Certificate(String),
    /// No answer within `upstream.timeout`: the outcome is unknown.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request was (maybe) sent.
    #[error("the upstream exchange failed: {0}")]
    Failed(String),
}

impl UpstreamError {
    /// What the failure proves about the request, for
    /// [`settle`](crate::idempotency::settle): a connection never made means
    /// it was never sent; anything later leaves its outcome unknown.
    pub fn outcome(&self) -> UpstreamOutcome {
        match self {
            UpstreamError::Connect(_) | UpstreamError::Certificate(_) => UpstreamOutcome::NotSent,
            UpstreamError::Timeout(_) | UpstreamError::Failed(_) => UpstreamOutcome::Unknown,
        }
    }
}

/// The upstream as the proxy sees it.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    scheme: Scheme,
    authority: Authority,
    host_header: HeaderValue,
    base_path: String,
    timeout: Duration,
}

impl Upstream {
    /// Builds the client. Fails for URLs the client cannot serve.
    pub fn new(config: &UpstreamConfig) -> anyhow::Result<Self> {
        let uri = &config.url;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            anyhow::bail!("upstream.url: only http:// and https:// upstreams are supported");
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("upstream.url has no host"))?;
        let host_header = HeaderValue::from_str(authority.as_str())?;
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        // The HTTPS connector below checks the scheme.
        connector.enforce_http(false);
        let tls = if scheme == Scheme::HTTPS {
            crate::tls::upstream_client_config(config.ca_file.as_deref())?
        } else {
            // Never used: the base URL, hence every request, is http://.
            crate::tls::client_config(rustls::RootCertStore::empty())?
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let client = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Ok(Upstream {
            client,
            scheme,
            authority,
            host_header,
            base_path,
            timeout: config.timeout,
        })
    }

    /// The exchange bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The `Host` the upstream is addressed as.
    pub fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    /// The upstream URI for a request's path and query.
    pub fn uri_for(&self, pq: Option<&PathAndQuery>) -> Result<Uri, http::Error> {
        let pq = pq.map_or("/", |p| p.as_str());
        let full = if self.base_path.is_empty() {
            pq.to_owned()
        } else {
            format!("{}{}", self.base_path, pq)
        };
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(full)
            .build()
    }

    /// Sends a request and waits for the response headers, within the
    /// exchange bound.
    pub async fn send(
        &self,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        *req.version_mut() = Version::HTTP_11;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() && is_tls_failure(&e) => {
                Err(UpstreamError::Certificate(error_chain(&e)))
            }
            Ok(Err(e)) if e.is_connect() => Err(UpstreamError::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(UpstreamError::Failed(error_chain(&e))),
        }
    }
}

/// Whether TLS refused the connection. rustls's error reaches us inside
/// `io::Error`s (one in another), whose `source()` skips the error each
/// wraps: look inside them too.
fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if is_tls_failure(inner) {
                return true;
            }
        }
        next = err.source();
    }
    false
}

/// An error and its causes on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    // DESIGN.md §2: refused → released; timed out or reset → kept.
    #[test]
    fn connect_failure_proves_the_request_was_not_sent() {
        assert_eq!(
            UpstreamError::Connect("refused".into()).outcome(),
            UpstreamOutcome::NotSent
        );
    }

    #[test]
    fn a_certificate_refused_by_tls_is_told_apart_from_other_io_errors() {
        let tls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert!(is_tls_failure(&tls));
        // As hyper-rustls hands it on: wrapped once more.
        assert!(is_tls_failure(&std::io::Error::other(tls)));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!is_tls_failure(&refused));
        assert_eq!(
            UpstreamError::Certificate("x".into()).outcome(),
            UpstreamOutcome::NotSent
        );
    }

    #[test]
    fn timeout_and_later_failure_leave_the_outcome_unknown() {
        assert_eq!(
            UpstreamError::Timeout(Duration::from_secs(1)).outcome(),
            UpstreamOutcome::Unknown
        );
        assert_eq!(
            UpstreamError::Failed("reset".into()).outcome(),
            UpstreamOutcome::Unknown
        );
    }
}
