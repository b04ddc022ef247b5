//! Request ids and the access log.
//!
//! Every request has an `X-Request-Id`: the client's, when it sent exactly
//! one that is sane (1–128 bytes of visible ASCII), otherwise one generated
//! here. The id is forwarded to the upstream, returned on every answer —
//! upstream responses, the proxy's own problems and replays alike — and
//! logged. A replay carries the id of the request being answered, not the
//! one stored with the original response: the id names an exchange, and a
//! retry is a new one (the original's id is in the original's log line).
//! A client value that is not sane is replaced, not forwarded: it would end
//! up in the upstream's logs and in ours.
//!
//! Generated ids are a per-process random prefix and a counter (32
//! lowercase hex digits): unique across replicas without a random draw or a
//! clock read per request.
//!
//! The access line is written when the response body has been handed to
//! the connection (or the client went away), so it carries the bytes
//! actually sent. It never carries a body, a query string (where tokens
//! travel) or a stored header value; the user agent is cut to 256 bytes
//! and anything but printable ASCII in it is escaped.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, USER_AGENT};
use http::{HeaderMap, Method};
use http_body::{Body, Frame, SizeHint};
use tracing::info;

use super::{BoxError, ProxyBody};
use crate::metrics::Outcome;

/// The request id header.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest request id accepted from a client, in bytes.
pub const MAX_REQUEST_ID: usize = 128;

/// Longest user agent logged, in bytes (before escaping).
pub const MAX_USER_AGENT: usize = 256;

/// Mints request ids: a random per-process prefix and a counter.
pub struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestIds {
    /// A source with a fresh random prefix.
    pub fn new() -> Self {
        RequestIds {
            prefix: uuid::Uuid::new_v4().as_u64_pair().0,
            next: AtomicU64::new(0),
        }
    }

    /// A new id.
    pub fn mint(&self) -> HeaderValue {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 32];
        hex(self.prefix, &mut buf[..16]);
        hex(n, &mut buf[16..]);
        HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
    }

    /// The request's id: the client's if sane, else a new one; the
    /// headers end up carrying exactly that id.
    pub fn assign(&self, headers: &mut HeaderMap) -> HeaderValue {
        let mut sent = headers.get_all(&REQUEST_ID).iter();
        let theirs = match (sent.next(), sent.next()) {
            (Some(v), None) if is_sane(v.as_bytes()) => Some(v.clone()),
            _ => None,
        };
        match theirs {
            Some(v) => v,
            None => {
                let id = self.mint();
                headers.insert(REQUEST_ID, id.clone());
                id
            }
        }
    }
}

/// Writes `n` as 16 lowercase hex digits.
fn hex(n: u64, out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in out.iter_mut().enumerate() {
        *b = DIGITS[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
}

/// 1–[`MAX_REQUEST_ID`] bytes of visible ASCII.
pub fn is_sane(id: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID).contains(&id.len()) && id.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// A header value for the log: at most `max` bytes, printable ASCII kept,
/// anything else written as `\xNN` (a backslash as `\\`).
pub fn escaped(value: &[u8], max: usize) -> String {
    let cut = &value[..value.len().min(max)];
    let mut out = String::with_capacity(cut.len());
    for &b in cut {
        match b {
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    if value.len() > max {
        out.push('…');
    }
    out
}

/// Whether the access line is logged at all (`idemproxy::access` at
/// `info`): when it is not, the request path wraps no body to count for it.
pub(super) fn enabled() -> bool {
    tracing::enabled!(target: "idemproxy::access", tracing::Level::INFO)
}

/// How many request body bytes were read.
pub(super) enum RequestBytes {
    /// Known up front (a buffered keyed body, or none read).
    Known(u64),
    /// Counted as a pass-through streams.
    Counted(Arc<AtomicU64>),
}

impl RequestBytes {
    fn get(&self) -> u64 {
        match self {
            RequestBytes::Known(n) => *n,
            RequestBytes::Counted(n) => n.load(Ordering::Relaxed),
        }
    }
}

/// Everything the access line says about a request but the byte count and
/// the time the body ended.
pub(super) struct AccessLine {
    pub(super) method: Method,
    /// The normalised path, without the query string.
    pub(super) path: String,
    pub(super) route: String,
    pub(super) key: Option<String>,
    pub(super) attempt: Option<i32>,
    pub(super) outcome: Outcome,
    pub(super) status: u16,
    pub(super) request_id: HeaderValue,
    pub(super) client: SocketAddr,
    pub(super) user_agent: Option<HeaderValue>,
    pub(super) request_bytes: RequestBytes,
    pub(super) started: Instant,
    /// Store and upstream time of a keyed request, in milliseconds.
    pub(super) timings: Option<(f64, f64)>,
}

impl AccessLine {
    /// The user agent of `headers`, if any, for the line.
    pub(super) fn user_agent(headers: &HeaderMap) -> Option<HeaderValue> {
        headers.get(USER_AGENT).cloned()
    }

    fn write(&self, response_bytes: u64) {
        let user_agent = self
            .user_agent
            .as_ref()
            .map(|v| escaped(v.as_bytes(), MAX_USER_AGENT));
        // A sane or minted id is visible ASCII: `to_str` cannot fail.
        let request_id = self.request_id.to_str().unwrap_or("-");
        info!(
            target: "idemproxy::access",
            method = %self.method,
            path = %self.path,
            route = %self.route,
            key = self.key.as_deref(),
            attempt = self.attempt,
            outcome = self.outcome.as_str(),
            status = self.status,
            duration_ms = self.started.elapsed().as_secs_f64() * 1000.0,
            store_ms = self.timings.map(|t| t.0),
            upstream_ms = self.timings.map(|t| t.1),
            request_id = %request_id,
            client = %self.client,
            user_agent = user_agent.as_deref().map(tracing::field::display),
            request_bytes = self.request_bytes.get(),
            response_bytes,
            "request"
        );
    }
}

/// A response body that counts what it yields and writes the access line
/// when it is dropped: after its end was sent, or when the client left.
pub(super) struct Logged {
    inner: ProxyBody,
    sent: u64,
    line: AccessLine,
}

impl Logged {
    /// Wraps `inner`, to log `line` when it is done.
    pub(super) fn new(inner: ProxyBody, line: AccessLine) -> Self {
        Logged {
            inner,
            sent: 0,
            line,
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.line.write(self.sent);
    }
}

impl Body for Logged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.sent += data.len() as u64;
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that counts what the upstream read of it.
pub(super) struct Counted<B> {
    inner: B,
    read: Arc<AtomicU64>,
}

impl<B> Counted<B> {
    /// Wraps `inner`, adding to `read`.
    pub(super) fn new(inner: B, read: Arc<AtomicU64>) -> Self {
        Counted { inner, read }
    }
}

impl<B> Body for Counted<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.read.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sane_client_id_is_kept() {
        let ids = RequestIds::new();
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("abc-123_X/y"));
        assert_eq!(ids.assign(&mut h), "abc-123_X/y");
        assert_eq!(h[REQUEST_ID], "abc-123_X/y");
    }

    #[test]
    fn an_absent_empty_long_spaced_or_repeated_id_is_replaced() {
        let ids = RequestIds::new();
        let long = "a".repeat(MAX_REQUEST_ID + 1);
        let cases: [&[&str]; 5] = [&[], &[""], &[&long], &["has space"], &["a", "b"]];
        for sent in cases {
            let mut h = HeaderMap::new();
            for v in sent {
                h.append(REQUEST_ID, HeaderValue::from_str(v).unwrap());
            }
            let id = ids.assign(&mut h);
            assert_eq!(id.len(), 32, "{sent:?}");
            assert!(is_sane(id.as_bytes()));
            let all: Vec<_> = h.get_all(REQUEST_ID).iter().collect();
            assert_eq!(all, [&id], "{sent:?}");
        }
        assert!(is_sane("a".repeat(MAX_REQUEST_ID).as_bytes()));
    }

    #[test]
    fn minted_ids_share_the_process_prefix_and_differ() {
        let ids = RequestIds::new();
        let (a, b) = (ids.mint(), ids.mint());
        assert_ne!(a, b);
        assert_eq!(a.as_bytes()[..16], b.as_bytes()[..16]);
        assert!(a.as_bytes().iter().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(
            RequestIds::new().mint().as_bytes()[..16],
            a.as_bytes()[..16]
        );
    }

    #[test]
    fn a_user_agent_is_escaped_and_bounded() {
        assert_eq!(escaped(b"curl/8.5 \"x\"", 256), "curl/8.5 \"x\"");
        assert_eq!(escaped(b"a\\b\x01\xff\tc", 256), "a\\\\b\\x01\\xff\\x09c");
        assert_eq!(escaped(b"abcdef", 3), "abc…");
    }
}
