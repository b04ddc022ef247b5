//! Forwarding: the request as the upstream gets it, and responses passed on
//! as they stream.
//!
//! Nothing here knows about keys or claims. A pass-through is streamed both
//! ways, never buffered: it is not fingerprinted, so there is no reason to
//! hold it (DESIGN.md §6, `max_request_body` applies to keyed requests only).
//! Hop-by-hop headers are dropped in both directions (§6).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{HeaderValue, HOST};
use http::{request, response, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tracing::warn;

use super::problem::{Forwarded, Problem};
use super::{headers, BoxError, ClientInfo, Handled, Proxy, ProxyBody, ATTEMPT};
use crate::metrics::Outcome;

impl Proxy {
    /// Forwards a request that is not keyed, untouched but for the
    /// forwarding headers.
    pub(super) async fn pass_through(
        &self,
        req: Request<ProxyBody>,
        client: &ClientInfo,
    ) -> Handled {
        let (parts, body) = req.into_parts();
        match self.forward_owned(parts, body, client, None) {
            Ok(req) => self.forward_streaming(req).await,
            Err(e) => Handled::problem(Problem::unforwardable(&e), Outcome::Rejected),
        }
    }

    /// Sends a request no claim protects and streams the answer back.
    pub(super) async fn forward_streaming(&self, req: Request<ProxyBody>) -> Handled {
        let started = Instant::now();
        let result = self.upstream.send(req).await;
        self.metrics.upstream(started.elapsed());
        match result {
            Ok(resp) => Handled::new(stream_response(resp), Outcome::Passthrough),
            Err(e) => {
                // The chain (address, OS error) is for the operator only.
                warn!(error = %e, "upstream exchange failed");
                Handled::problem(
                    Problem::upstream(&e, Forwarded::Unprotected),
                    Outcome::Passthrough,
                )
            }
        }
    }

    /// The request as the upstream gets it (the head copied: a keyed
    /// request keeps its own for the access line and a later forward).
    pub(super) fn forward_request(
        &self,
        parts: &request::Parts,
        body: ProxyBody,
        client: &ClientInfo,
        attempt: Option<i32>,
    ) -> Result<Request<ProxyBody>, http::Error> {
        let mut head = Request::new(());
        *head.method_mut() = parts.method.clone();
        *head.uri_mut() = parts.uri.clone();
        *head.headers_mut() = parts.headers.clone();
        let (head, ()) = head.into_parts();
        self.forward_owned(head, body, client, attempt)
    }

    /// The request as the upstream gets it, made from the client's head
    /// in place.
    fn forward_owned(
        &self,
        parts: request::Parts,
        body: ProxyBody,
        client: &ClientInfo,
        attempt: Option<i32>,
    ) -> Result<Request<ProxyBody>, http::Error> {
        let uri = self.upstream.uri_for(parts.uri.path_and_query())?;
        let request::Parts {
            method,
            uri: original_uri,
            headers: mut h,
            ..
        } = parts;
        headers::strip_hop_by_hop(&mut h);
        // Only the proxy speaks in a derived-key header: a client's value
        // could name another tenant's key to an upstream that deduplicates
        // on it. Every route's header goes, whatever route (if any) this
        // request took; a keyed forward then sets its own.
        for name in &self.derived_key_headers {
            h.remove(name);
        }
        // What the client addressed (a Host of visible ASCII, else the
        // authority of an absolute-form target), before Host is replaced.
        let original_host = match h.get(HOST) {
            Some(v) if v.to_str().is_ok() => Some(v.clone()),
            Some(_) => None,
            None => original_uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
        };
        headers::add_forwarded(&mut h, &client.forwarded_for, client.proto, original_host);
        h.insert(HOST, self.upstream.host_header().clone());
        match attempt {
            Some(a) => {
                h.insert(ATTEMPT, HeaderValue::from(a));
            }
            None => {
                h.remove(ATTEMPT);
            }
        }
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = h;
        Ok(req)
    }
}

/// An upstream response passed on as it streams, hop-by-hop headers removed.
pub(super) fn stream_response(resp: Response<Incoming>) -> Response<ProxyBody> {
    let (parts, body) = resp.into_parts();
    response_from(parts, body.map_err(BoxError::from).boxed())
}

/// A response from an upstream head and any body, hop-by-hop headers
/// removed.
pub(super) fn response_from(mut parts: response::Parts, body: ProxyBody) -> Response<ProxyBody> {
    headers::strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body)
}

/// The part of a response body already read, then the rest as it streams.
pub(super) struct PrefixedBody {
    /// Sent first; `None` once sent.
    prefix: Option<Bytes>,
    /// The body after the prefix.
    rest: Incoming,
}

impl PrefixedBody {
    /// `prefix`, then `rest`.
    pub(super) fn new(prefix: Bytes, rest: Incoming) -> Self {
        PrefixedBody {
            prefix: Some(prefix),
            rest,
        }
    }
}

impl Body for PrefixedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        Pin::new(&mut self.rest)
            .poll_frame(cx)
            .map_err(BoxError::from)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.rest.size_hint();
        if let Some(p) = &self.prefix {
            let n = p.len() as u64;
            // Raise the upper bound first: set_lower asserts lower <= upper.
            if let Some(u) = hint.upper() {
                hint.set_upper(u + n);
            }
            hint.set_lower(hint.lower() + n);
        }
        hint
    }
}
