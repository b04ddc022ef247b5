//! The one place where the proxy's own refusals become HTTP responses:
//! RFC 9457 `application/problem+json`, with one stable `type` per case so
//! a client can tell a proxy 409 from an upstream 409.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use serde::Serialize;

use super::{full, ProxyBody};

/// Prefix of every problem `type`.
pub const TYPE_PREFIX: &str = "urn:idemproxy:problem:";

/// Every answer the proxy makes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    /// A keyed route with `key = "required"` and no key header.
    MissingKey,
    /// Key empty, too long, not visible ASCII, malformed or repeated.
    InvalidKey,
    /// The route requires a tenant header and it is absent.
    MissingTenant,
    /// Tenant header repeated or not usable.
    InvalidTenant,
    /// Request body larger than `max_request_body`.
    RequestTooLarge,
    /// The request body could not be read (client aborted, bad framing).
    InvalidRequest,
    /// Same key, same request, original still in flight.
    RequestInProgress,
    /// Same key, different request.
    KeyReused,
    /// The store is unreachable or failing: fail closed.
    StoreUnavailable,
    /// The upstream could not be connected to; the request was not sent.
    UpstreamUnreachable,
    /// The upstream did not answer in time; the outcome is unknown.
    UpstreamTimeout,
    /// The upstream connection failed after the request was sent.
    UpstreamFailed,
    /// A replay of a request whose response was too large to store.
    ResponseNotStored,
}

impl ProblemKind {
    /// HTTP status of this problem.
    pub fn status(self) -> StatusCode {
        use ProblemKind::*;
        match self {
            MissingKey | InvalidKey | MissingTenant | InvalidTenant | InvalidRequest => {
                StatusCode::BAD_REQUEST
            }
            RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RequestInProgress => StatusCode::CONFLICT,
            KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            UpstreamUnreachable | UpstreamFailed | ResponseNotStored => StatusCode::BAD_GATEWAY,
            UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The stable slug that ends the `type` URI.
    pub fn slug(self) -> &'static str {
        use ProblemKind::*;
        match self {
            MissingKey => "missing-key",
            InvalidKey => "invalid-key",
            MissingTenant => "missing-tenant",
            InvalidTenant => "invalid-tenant",
            RequestTooLarge => "request-too-large",
            InvalidRequest => "invalid-request",
            RequestInProgress => "request-in-progress",
            KeyReused => "key-reused",
            StoreUnavailable => "store-unavailable",
            UpstreamUnreachable => "upstream-unreachable",
            UpstreamTimeout => "upstream-timeout",
            UpstreamFailed => "upstream-failed",
            ResponseNotStored => "response-not-stored",
        }
    }

    /// A short, fixed, human-readable summary.
    pub fn title(self) -> &'static str {
        use ProblemKind::*;
        match self {
            MissingKey => "Idempotency key required",
            InvalidKey => "Invalid idempotency key",
            MissingTenant => "Tenant required",
            InvalidTenant => "Invalid tenant",
            RequestTooLarge => "Request body too large",
            InvalidRequest => "Invalid request",
            RequestInProgress => "A request with this idempotency key is in progress",
            KeyReused => "Idempotency key reused with a different request",
            StoreUnavailable => "Idempotency store unavailable",
            UpstreamUnreachable => "Upstream unreachable",
            UpstreamTimeout => "Upstream timed out",
            UpstreamFailed => "Upstream connection failed",
            ResponseNotStored => "Original response was not stored",
        }
    }

    /// The full `type` URI.
    pub fn type_uri(self) -> String {
        format!("{TYPE_PREFIX}{}", self.slug())
    }
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_: String,
    title: &'static str,
    status: u16,
    detail: &'a str,
}

/// A proxy-made answer under construction.
#[derive(Debug, Clone)]
pub struct Problem {
    /// Which case.
    pub kind: ProblemKind,
    /// What happened, for a human; never a body or a secret.
    pub detail: String,
    /// `Retry-After` seconds, for 409 and 503.
    pub retry_after: Option<u64>,
}

impl Problem {
    /// A problem with a detail message.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds `Retry-After`.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The HTTP response.
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.kind.status();
        let body = Body {
            type_: self.kind.type_uri(),
            title: self.kind.title(),
            status: status.as_u16(),
            detail: &self.detail,
        };
        let json = serde_json::to_vec(&body).unwrap_or_default();
        let mut resp = Response::new(full(Bytes::from(json)));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    const ALL: [ProblemKind; 13] = [
        ProblemKind::MissingKey,
        ProblemKind::InvalidKey,
        ProblemKind::MissingTenant,
        ProblemKind::InvalidTenant,
        ProblemKind::RequestTooLarge,
        ProblemKind::InvalidRequest,
        ProblemKind::RequestInProgress,
        ProblemKind::KeyReused,
        ProblemKind::StoreUnavailable,
        ProblemKind::UpstreamUnreachable,
        ProblemKind::UpstreamTimeout,
        ProblemKind::UpstreamFailed,
        ProblemKind::ResponseNotStored,
    ];

    #[test]
    fn statuses_match_the_design_table() {
        use ProblemKind::*;
        let expected = [
            (MissingKey, 400),
            (InvalidKey, 400),
            (MissingTenant, 400),
            (InvalidTenant, 400),
            (RequestTooLarge, 413),
            (InvalidRequest, 400),
            (RequestInProgress, 409),
            (KeyReused, 422),
            (StoreUnavailable, 503),
            (UpstreamUnreachable, 502),
            (UpstreamTimeout, 504),
            (UpstreamFailed, 502),
            (ResponseNotStored, 502),
        ];
        for (kind, status) in expected {
            assert_eq!(kind.status().as_u16(), status, "{kind:?}");
        }
    }

    #[test]
    fn every_case_has_its_own_type_uri() {
        let mut uris: Vec<String> = ALL.iter().map(|k| k.type_uri()).collect();
        uris.sort();
        uris.dedup();
        assert_eq!(uris.len(), ALL.len());
    }

    #[tokio::test]
    async fn body_has_type_title_status_and_detail() {
        let resp = Problem::new(ProblemKind::RequestInProgress, "wait")
            .retry_after(3)
            .into_response();
        assert_eq!(resp.status(), 409);
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(resp.headers()[RETRY_AFTER], "3");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["type"], "urn:idemproxy:problem:request-in-progress");
        assert_eq!(v["status"], 409);
        assert_eq!(v["detail"], "wait");
        assert!(v["title"].as_str().unwrap().contains("in progress"));
    }
}
