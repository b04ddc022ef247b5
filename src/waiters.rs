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
//! Channel payloads name a key by its [`KeyId`](crate::idempotency::KeyId):
//! nothing about a tenant or its keys travels in clear, and the payload has
//! a fixed size far below PostgreSQL's limit. The listening connection is
//! [`crate::store::notify`]'s; this module is only the in-memory registry.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

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
    /// `None` only during drop.
    notify: Option<Arc<Notify>>,
}

impl WaitGuard<'_> {
    /// The key's wake-up signal. Create the `notified()` future *before*
    /// reading the record: tokio guarantees it then sees every wake-up sent
    /// after its creation, so none falls between the read and the sleep.
    pub fn notify(&self) -> Arc<Notify> {
        self.notify.clone().unwrap_or_default()
    }
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.waiters.count.fetch_sub(1, Ordering::SeqCst);
        let mut keys = self.waiters.lock();
        // Our reference goes while the lock is held, so that of two guards
        // dropping at once the second sees the first's gone: the last one
        // out finds the map's reference alone and removes the entry.
        // (Registration clones under the same lock.)
        drop(self.notify.take());
        if keys
            .get(&self.id)
            .is_some_and(|n| Arc::strong_count(n) == 1)
        {
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
            notify: Some(notify),
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

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    #[test]
    fn guards_of_one_key_dropping_at_once_leave_no_entry() {
        // Many rounds of two threads dropping the two guards of one key at
        // the same moment: the entry must always go with the last guard.
        let w = Arc::new(Waiters::new(1024));
        for round in 0..2_000 {
            let id = format!("k{}", round % 7);
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (w, id, barrier) = (w.clone(), id.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let guard = w.register(id).unwrap();
                        barrier.wait();
                        drop(guard);
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert!(w.lock().is_empty(), "round {round}: entry leaked");
            assert_eq!(w.waiting(), 0);
        }
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
