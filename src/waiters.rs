//! Duplicates that wait for their original (route setting `wait`).
//!
//! A duplicate of an in-flight key registers here and sleeps until the key
//! changes — completed, released, or its lease ran out — or its `wait`
//! runs out. Changes are pushed: the owner that completes or releases a key
//! on a waiting route sends `NOTIFY` in the same statement, and each
//! process keeps one listening connection (not one per waiter) that wakes
//! the local waiters of that key. A completion on this process also wakes
//! its own waiters directly, without the round trip.
//!
//! Channel payloads name a key by a digest of `(tenant, key)`: nothing
//! about a tenant or its keys travels in clear, and the payload has a fixed
//! size far below PostgreSQL's limit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::{watch, Notify};
use tokio_postgres::AsyncMessage;
use tracing::{info, warn};

use crate::cache::ResponseCache;
use crate::idempotency::{IdempotencyKey, TenantId};
use crate::store::Store;

/// The notification channel.
pub const CHANNEL: &str = "idemproxy_keys";

/// Names a key on the channel: hex of the first 16 bytes of
/// SHA-256(tenant, 0, key).
pub fn key_id(tenant: &TenantId, key: &IdempotencyKey) -> String {
    raw_key_id(tenant.as_str(), key.as_str())
}

/// [`key_id`] of a stored tenant and key given as text (operators' tools).
pub fn raw_key_id(tenant: &str, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(tenant.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    hex::encode(&h.finalize()[..16])
}

/// The process's waiting duplicates, bounded.
pub struct Waiters {
    keys: Mutex<HashMap<String, Arc<Notify>>>,
    count: AtomicUsize,
    max: usize,
}

/// One registered waiter; unregisters on drop.
pub struct WaitGuard<'a> {
    waiters: &'a Waiters,
    id: String,
    notify: Arc<Notify>,
}

impl WaitGuard<'_> {
    /// The key's wake-up signal. Create the `notified()` future *before*
    /// reading the record: tokio guarantees it then sees every wake-up sent
    /// after its creation, so none falls between the read and the sleep.
    pub fn notify(&self) -> Arc<Notify> {
        self.notify.clone()
    }
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.waiters.count.fetch_sub(1, Ordering::SeqCst);
        let mut keys = self.waiters.lock();
        // The map holds one reference and this guard another: last waiter.
        if Arc::strong_count(&self.notify) == 2 {
            keys.remove(&self.id);
        }
    }
}

impl Waiters {
    /// At most `max` waiters at once.
    pub fn new(max: usize) -> Self {
        Waiters {
            keys: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a waiter for `id`; `None` when the bound is reached.
    pub fn register(&self, id: String) -> Option<WaitGuard<'_>> {
        let previous = self.count.fetch_add(1, Ordering::SeqCst);
        if previous >= self.max {
            self.count.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        let notify = self.lock().entry(id.clone()).or_default().clone();
        Some(WaitGuard {
            waiters: self,
            id,
            notify,
        })
    }

    /// Wakes every waiter of `id`.
    pub fn wake(&self, id: &str) {
        if let Some(n) = self.lock().get(id) {
            n.notify_waiters();
        }
    }

    /// Wakes every waiter (after the listener reconnects: changes may have
    /// been missed while it was away).
    pub fn wake_all(&self) {
        for n in self.lock().values() {
            n.notify_waiters();
        }
    }

    /// How many duplicates are waiting now.
    pub fn waiting(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// Listens on the channel, wakes local waiters of a changed key and drops
/// it from the response cache (an operator's release), reconnecting with
/// backoff until shutdown.
pub async fn listen(
    store: Store,
    waiters: Arc<Waiters>,
    cache: Arc<ResponseCache>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut delay = Duration::from_millis(100);
    loop {
        match store.connect_dedicated().await {
            Ok((client, mut connection)) => {
                let pump = async {
                    loop {
                        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                            Some(Ok(AsyncMessage::Notification(n))) => {
                                cache.invalidate(n.payload());
                                waiters.wake(n.payload());
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return e.to_string(),
                            None => return "connection closed".to_string(),
                        }
                    }
                };
                let subscribe = async {
                    match client.batch_execute(&format!("LISTEN {CHANNEL}")).await {
                        Ok(()) => {
                            info!("listening for key completions");
                            // Anything that changed while we were away.
                            cache.clear();
                            waiters.wake_all();
                            std::future::pending::<()>().await;
                        }
                        Err(e) => warn!(error = %e, "LISTEN failed"),
                    }
                };
                tokio::select! {
                    reason = pump => {
                        warn!(%reason, "completion listener lost its connection; reconnecting");
                        delay = Duration::from_millis(100);
                    }
                    () = subscribe => {}
                    () = crate::server::stopped(&mut shutdown) => return,
                }
                waiters.wake_all();
            }
            Err(e) => warn!(error = %e, retry_in = ?delay, "completion listener cannot connect"),
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = crate::server::stopped(&mut shutdown) => return,
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ids_separate_tenants_and_keys() {
        let k = |s: &str| IdempotencyKey::parse(s.as_bytes(), 255).unwrap();
        let a = key_id(&TenantId::from_stored("a"), &k("b"));
        assert_ne!(a, key_id(&TenantId::from_stored("ab"), &k("x")));
        assert_ne!(a, key_id(&TenantId::from_stored("b"), &k("b")));
        assert_eq!(a, key_id(&TenantId::from_stored("a"), &k("b")));
        assert_eq!(a.len(), 32);
    }

    #[test]
    fn registrations_are_bounded_and_released_on_drop() {
        let w = Waiters::new(2);
        let g1 = w.register("x".into()).unwrap();
        let _g2 = w.register("y".into()).unwrap();
        assert!(w.register("z".into()).is_none());
        assert_eq!(w.waiting(), 2);
        drop(g1);
        assert_eq!(w.waiting(), 1);
        assert!(w.register("z".into()).is_some());
        assert!(!w.lock().contains_key("x"), "last waiter removes the key");
    }

    #[tokio::test]
    async fn wake_reaches_a_notified_future_created_before_it() {
        let w = Waiters::new(4);
        let g = w.register("k".into()).unwrap();
        let notify = g.notify();
        let notified = notify.notified();
        w.wake("k");
        tokio::time::timeout(Duration::from_secs(1), notified)
            .await
            .unwrap();
    }
}
