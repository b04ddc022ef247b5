//! The one place where the proxy's own refusals become HTTP responses:
//! RFC 9457 `application/problem+json`, with one stable `type` per case so
//! a client can tell a proxy 409 from an upstream 409.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use serde::Serialize;

use super::upstream::UpstreamError;
use super::{full, ProxyBody};
use crate::idempotency::decision::retry_after_secs;

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
    /// A path whose meaning depends on who decodes it (an encoded `/` that
    /// changes the route, `..` above the root).
    AmbiguousPath,
    /// A keyed body that did not arrive within `body_read_timeout`.
    RequestTimeout,
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
            MissingKey | InvalidKey | MissingTenant | InvalidTenant | InvalidRequest
            | AmbiguousPath => StatusCode::BAD_REQUEST,
            RequestTimeout => StatusCode::REQUEST_TIMEOUT,
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
            AmbiguousPath => "ambiguous-path",
            RequestTimeout => "request-timeout",
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
            AmbiguousPath => "Ambiguous path",
            RequestTimeout => "Request body timed out",
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

/// How a request whose upstream exchange failed had been forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// With no claim behind it: a pass-through, or a keyed request sent
    /// unprotected because the store was down (`on_store_error`).
    Unprotected,
    /// Under an owned claim whose lease is `lease`.
    Claimed {
        /// The route's lease: how long a claim kept in flight blocks a retry.
        lease: Duration,
    },
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

    /// The one answer to an upstream exchange that produced no response.
    /// The status and type say what the failure proves (never sent,
    /// timed out, failed after sending); the detail says what the client
    /// may do next, which depends on whether a claim protected the request.
    ///
    /// The texts are fixed: the error's chain names the upstream's address
    /// and the OS error, which are no client's business (DESIGN.md §8.7).
    /// Callers log the chain, once.
    pub fn upstream(e: &UpstreamError, forwarded: Forwarded) -> Self {
        let kind = match e {
            UpstreamError::Connect(_) | UpstreamError::Certificate(_) => {
                ProblemKind::UpstreamUnreachable
            }
            UpstreamError::Timeout(_) => ProblemKind::UpstreamTimeout,
            UpstreamError::Failed(_) => ProblemKind::UpstreamFailed,
        };
        let Forwarded::Claimed { lease } = forwarded else {
            let detail = match e {
                UpstreamError::Connect(_) => {
                    "the upstream could not be reached; the request was not sent"
                }
                UpstreamError::Certificate(_) => {
                    "the upstream's TLS certificate could not be verified; the request was not sent"
                }
                UpstreamError::Timeout(_) => "the upstream did not answer in time",
                UpstreamError::Failed(_) => {
                    "the upstream connection failed after the request was sent"
                }
            };
            return Problem::new(kind, detail);
        };
        match e {
            // Released: nothing ran, so nothing to wait for.
            UpstreamError::Connect(_) => Problem::new(
                kind,
                "the upstream could not be reached; the request was not sent and may be retried at once",
            ),
            UpstreamError::Certificate(_) => Problem::new(
                kind,
                "the upstream's TLS certificate could not be verified; the request was not sent and may be retried at once",
            ),
            // Kept in flight: a retry gets 409 until the lease expires.
            UpstreamError::Timeout(_) => Problem::new(
                kind,
                "the upstream did not answer in time; the request may have been executed. Retry with the same key after the lease expires",
            )
            .retry_after(retry_after_secs(lease)),
            UpstreamError::Failed(_) => Problem::new(
                kind,
                "the upstream connection failed after the request was sent; it may have been executed. Retry with the same key after the lease expires",
            )
            .retry_after(retry_after_secs(lease)),
        }
    }

    /// A request whose upstream URI cannot be built from its path and
    /// query: nothing was sent.
    pub fn unforwardable(e: &http::Error) -> Self {
        Problem::new(
            ProblemKind::InvalidRequest,
            format!("the request cannot be forwarded: {e}"),
        )
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

    const ALL: [ProblemKind; 15] = [
        ProblemKind::MissingKey,
        ProblemKind::InvalidKey,
        ProblemKind::MissingTenant,
        ProblemKind::InvalidTenant,
        ProblemKind::RequestTooLarge,
        ProblemKind::InvalidRequest,
        ProblemKind::AmbiguousPath,
        ProblemKind::RequestTimeout,
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
            (AmbiguousPath, 400),
            (RequestTimeout, 408),
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

    #[test]
    fn upstream_errors_map_to_the_same_case_claimed_or_not() {
        let lease = Duration::from_millis(2500);
        let cases = [
            (
                UpstreamError::Connect("refused".into()),
                ProblemKind::UpstreamUnreachable,
            ),
            (
                UpstreamError::Certificate("unknown issuer".into()),
                ProblemKind::UpstreamUnreachable,
            ),
            (
                UpstreamError::Timeout(Duration::from_secs(30)),
                ProblemKind::UpstreamTimeout,
            ),
            (
                UpstreamError::Failed("reset".into()),
                ProblemKind::UpstreamFailed,
            ),
        ];
        for (e, kind) in cases {
            let plain = Problem::upstream(&e, Forwarded::Unprotected);
            assert_eq!(plain.kind, kind, "{e}");
            assert_eq!(plain.retry_after, None);
            assert_eq!(
                Problem::upstream(&e, Forwarded::Claimed { lease }).kind,
                kind,
                "{e}"
            );
        }
    }

    #[test]
    fn unsent_claimed_request_may_be_retried_at_once() {
        let e = UpstreamError::Connect("connection refused".into());
        let p = Problem::upstream(
            &e,
            Forwarded::Claimed {
                lease: Duration::from_secs(10),
            },
        );
        assert_eq!(p.retry_after, None);
        assert!(p.detail.contains("may be retried at once"));
    }

    #[test]
    fn upstream_problems_never_carry_the_error_chain() {
        let chain = "client error (Connect): tcp connect error: Connection refused (os error 111) to 10.1.2.3:8443";
        for e in [
            UpstreamError::Connect(chain.into()),
            UpstreamError::Certificate(chain.into()),
            UpstreamError::Failed(chain.into()),
        ] {
            for forwarded in [
                Forwarded::Unprotected,
                Forwarded::Claimed {
                    lease: Duration::from_secs(1),
                },
            ] {
                let p = Problem::upstream(&e, forwarded);
                for leak in ["10.1.2.3", "8443", "os error", "refused", "tcp"] {
                    assert!(!p.detail.contains(leak), "{leak:?} in {:?}", p.detail);
                }
            }
        }
    }

    #[test]
    fn claimed_request_of_unknown_outcome_is_retried_after_the_lease() {
        let lease = Duration::from_millis(2500);
        for e in [
            UpstreamError::Timeout(Duration::from_secs(30)),
            UpstreamError::Failed("reset".into()),
        ] {
            let p = Problem::upstream(&e, Forwarded::Claimed { lease });
            assert_eq!(p.retry_after, Some(3), "{e}");
            assert!(p.detail.contains("after the lease expires"), "{e}");
        }
    }

    #[test]
    fn unforwardable_request_is_an_invalid_request() {
        let e = http::Uri::builder()
            .path_and_query("not a path")
            .build()
            .unwrap_err();
        let p = Problem::unforwardable(&e);
        assert_eq!(p.kind, ProblemKind::InvalidRequest);
        assert!(p.detail.starts_with("the request cannot be forwarded: "));
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
