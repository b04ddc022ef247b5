//! The body of [`crate::SLOW_BODY_HEADER`]: small chunks with a pause
//! between them, for clients and proxies that must cope with a slow
//! upstream.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame};
use tokio::time::Sleep;

use crate::{SLOW_BODY_CHUNK, SLOW_BODY_MAX_CHUNKS};

/// A response body sent in chunks with a pause between them.
pub(crate) struct SlowBody {
    remaining: Bytes,
    chunk: usize,
    interval: Duration,
    pause: Option<Pin<Box<Sleep>>>,
}

impl SlowBody {
    pub(crate) fn new(payload: Bytes, interval: Duration) -> Self {
        let chunk = SLOW_BODY_CHUNK.max(payload.len().div_ceil(SLOW_BODY_MAX_CHUNKS));
        SlowBody {
            remaining: payload,
            chunk,
            interval,
            pause: None,
        }
    }
}

impl Body for SlowBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if let Some(pause) = this.pause.as_mut() {
            ready!(pause.as_mut().poll(cx));
            this.pause = None;
        }
        if this.remaining.is_empty() {
            return Poll::Ready(None);
        }
        let n = this.chunk.min(this.remaining.len());
        let data = this.remaining.split_to(n);
        if !this.remaining.is_empty() {
            this.pause = Some(Box::pin(tokio::time::sleep(this.interval)));
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining.is_empty()
    }
}
