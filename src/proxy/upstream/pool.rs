//! The idle connections to the one upstream.
//!
//! idemproxy has exactly one upstream, fixed at startup, so the pool is
//! keyed by nothing: a stack of HTTP/1.1 senders behind one mutex. (hyper-util's
//! legacy pool hashed a (scheme, authority) key twice per request and
//! spawned a task per response to put its connection back; see issue #15.)
//!
//! A sender goes back on the stack as soon as its response head arrives,
//! while the response body may still be streaming: an HTTP/1.1 connection
//! only becomes usable again once that body has been read, and hyper says
//! so through [`SendRequest::is_ready`]. Checkout takes the most recently
//! returned sender that is ready (LIFO keeps few connections warm), skips
//! the busy ones and drops the closed and the stale. That costs an atomic
//! load per busy connection instead of a task per request.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use hyper::client::conn::http1::SendRequest;

use crate::proxy::ProxyBody;

/// How long a connection may sit unused before it is dropped: upstreams
/// commonly close theirs after 60–75 s, and one closed under us while idle
/// costs a retry.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The most connections kept (busy ones included): past it, a connection
/// whose exchange is over is closed rather than kept.
pub(super) const MAX_KEPT: usize = 1024;

/// A connection on the stack.
struct Kept {
    /// Sends the next request on the connection (driven by its own task).
    sender: SendRequest<ProxyBody>,
    /// When it was last put back: an upper bound on how long it has been
    /// idle (it may have been busy streaming a body for part of that).
    since: Instant,
}

/// The connections kept for reuse.
pub(super) struct Pool {
    /// Most recently returned last.
    kept: Mutex<Vec<Kept>>,
    /// The bound on `kept`.
    max: usize,
}

impl Pool {
    pub(super) fn new(max: usize) -> Self {
        Pool {
            kept: Mutex::new(Vec::new()),
            max,
        }
    }

    /// The most recently used connection that is ready for a request, if
    /// any. Closed and stale connections met on the way are dropped; busy
    /// ones stay.
    pub(super) fn checkout(&self) -> Option<SendRequest<ProxyBody>> {
        let now = Instant::now();
        let mut kept = self.lock();
        let mut i = kept.len();
        while i > 0 {
            i -= 1;
            let k = &kept[i];
            if k.sender.is_closed() {
                kept.remove(i);
            } else if k.sender.is_ready() {
                let k = kept.remove(i);
                // Idle past the timeout: the upstream may be closing it
                // right now. Not worth the race.
                if now.saturating_duration_since(k.since) < IDLE_TIMEOUT {
                    return Some(k.sender);
                }
            }
        }
        None
    }

    /// Keeps a connection whose request was sent (its response may still be
    /// streaming) for a later request.
    pub(super) fn put(&self, sender: SendRequest<ProxyBody>) {
        if sender.is_closed() {
            return;
        }
        let k = Kept {
            sender,
            since: Instant::now(),
        };
        let mut kept = self.lock();
        if kept.len() < self.max {
            kept.push(k);
        }
    }

    /// Drops the closed connections and those idle past the timeout, so
    /// that a pool nobody uses lets its connections go.
    pub(super) fn sweep(&self, now: Instant) {
        self.lock().retain(|k| {
            let stale =
                k.sender.is_ready() && now.saturating_duration_since(k.since) >= IDLE_TIMEOUT;
            !k.sender.is_closed() && !stale
        });
    }

    /// How many connections are kept, busy ones included.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether every kept connection has been seen closed.
    #[cfg(test)]
    pub(super) fn all_closed(&self) -> bool {
        self.lock().iter().all(|k| k.sender.is_closed())
    }

    /// Whether every kept connection is ready for a request.
    #[cfg(test)]
    pub(super) fn all_ready(&self) -> bool {
        self.lock().iter().all(|k| k.sender.is_ready())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Kept>> {
        // The critical sections cannot panic half-way through: the vector
        // stays consistent.
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
