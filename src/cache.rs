//! A bounded in-process cache of completed responses.
//!
//! A completed record is immutable until it expires, so a replica may
//! replay it from memory instead of reading it again: a replay on a warm
//! replica then costs about what a pass-through costs. Keys enter the cache
//! on their first replay (read from the database), not on completion: most
//! keys are never retried, and caching every completion would churn memory
//! under a stream of new keys for nothing. The cache is bounded
//! in bytes (oldest entries leave first) and each entry lives until the
//! earlier of the record's expiry and `response_cache_ttl`. The TTL bounds
//! the one thing the cache could get wrong: an operator's manual release of
//! a completed key (`keys release --force`). That release also sends a
//! notification that every replica's listener turns into an invalidation,
//! so in practice it takes effect at once; the TTL covers a listener that
//! was disconnected at that moment.
//!
//! A replay reads the record, then caches it. An invalidation that arrives
//! between the two (the release committed after the read) must win, or the
//! released response would be replayed from memory until the TTL. So a
//! caller takes a [`Ticket`] before its read, and [`ResponseCache::put`]
//! refuses an entry whose key was invalidated (or the cache cleared) since
//! the ticket. Invalidations are remembered for `window` (the store's
//! timeout bounds a read, so an older ticket is refused outright).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use crate::idempotency::fingerprint::Inputs;
use crate::idempotency::{Fingerprint, RecordKey};
use crate::metrics::CacheSample;
use crate::store::StoredResponse;

/// A cached completion.
#[derive(Debug, Clone)]
pub struct Cached {
    /// Fingerprint of the request that completed the key.
    pub fingerprint: Fingerprint,
    /// The stored response.
    pub response: Arc<StoredResponse>,
    /// When the record expires (the database's clock).
    pub expires_at: SystemTime,
    /// Its replays' headers, as the replay that filled the entry answered
    /// them: the stored ones (their values share the stored bytes), then
    /// the proxy's own (`Idempotency-Replayed`, `Idempotency-Key-Expires`).
    /// A replay clones the map instead of parsing every name again.
    pub headers: http::HeaderMap,
    /// The inputs of the request that filled the entry (whose fingerprint
    /// is `fingerprint`), when its body was small enough to keep: a retry
    /// with the same bytes is known to match without being fingerprinted.
    pub seen: Option<Inputs>,
}

struct Entry {
    tenant: String,
    key: String,
    cached: Arc<Cached>,
    /// Local deadline: the TTL, or earlier if the record expires first.
    until: Instant,
    size: usize,
    /// Distinguishes re-insertions of a key in the eviction queue.
    generation: u64,
}

struct Inner {
    /// By key id (the channel form of [`KeyId`]): what a notification names.
    map: HashMap<String, Entry>,
    order: VecDeque<(String, u64)>,
    bytes: usize,
    generation: u64,
    /// Counts invalidations and clears; a [`Ticket`] holds its value.
    epoch: u64,
    /// The epoch of the last clear.
    cleared: u64,
    /// Recent invalidations: key id → epoch, and the same in time order.
    invalidated: HashMap<String, u64>,
    invalidations: VecDeque<(String, u64, Instant)>,
}

/// Taken before reading a record that may be cached: see the module docs.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    epoch: u64,
    at: Instant,
}

/// The cache. With a budget of 0 it holds nothing.
pub struct ResponseCache {
    inner: Mutex<Inner>,
    max_bytes: usize,
    ttl: Duration,
    window: Duration,
    /// Lookups that found a fresh entry, since start.
    hits: AtomicU64,
    /// Lookups that did not, since start.
    misses: AtomicU64,
    /// Entries pushed out by the byte budget, since start.
    evictions: AtomicU64,
}

/// What an entry costs in memory, allocator overhead included: the bytes,
/// plus per allocation (each header name and value, tenant, key, the key id
/// twice, the response, the map and queue slots) a measured allowance. A
/// header counts its name twice (stored, and in the replay's prebuilt map,
/// whose values share the stored bytes) and the map's slot. The request's
/// inputs, when kept, count their bytes and their six allocations.
fn size_of(tenant: &str, key: &str, r: &StoredResponse, seen: Option<&Inputs>) -> usize {
    let headers: usize = r
        .headers
        .iter()
        .map(|(n, v)| 2 * n.len() + v.len() + 96 + 64)
        .sum();
    let seen = seen.map_or(0, |s| s.held_bytes() + 6 * 32 + 64);
    tenant.len() + key.len() + headers + r.body.as_ref().map_or(0, |b| b.len()) + seen + 512
}

impl ResponseCache {
    /// A cache of at most `max_bytes`, entries at most `ttl` old; a read
    /// that may fill it lasts at most `window` (the store's timeout).
    pub fn new(max_bytes: u64, ttl: Duration, window: Duration) -> Self {
        ResponseCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: VecDeque::new(),
                bytes: 0,
                generation: 0,
                epoch: 0,
                cleared: 0,
                invalidated: HashMap::new(),
                invalidations: VecDeque::new(),
            }),
            max_bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX),
            ttl,
            window,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// A ticket for a read whose result may be [`put`](Self::put).
    pub fn ticket(&self) -> Ticket {
        Ticket {
            epoch: if self.max_bytes == 0 {
                0
            } else {
                self.lock().epoch
            },
            at: Instant::now(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The completion of `(tenant, key)`, if cached and still fresh.
    pub fn get(&self, record: &RecordKey) -> Option<Arc<Cached>> {
        if self.max_bytes == 0 {
            return None;
        }
        let (tenant, key) = (&record.tenant, &record.key);
        let id = record.id().channel();
        let found = self.lookup(id.as_str(), tenant.as_str(), key.as_str());
        let tally = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        tally.fetch_add(1, Ordering::Relaxed);
        found
    }

    fn lookup(&self, id: &str, tenant: &str, key: &str) -> Option<Arc<Cached>> {
        let mut inner = self.lock();
        let entry = inner.map.get(id)?;
        // The id is a digest: the entry must be this very tenant and key.
        if entry.tenant != tenant || entry.key != key {
            return None;
        }
        if Instant::now() < entry.until {
            return Some(Arc::clone(&entry.cached));
        }
        if let Some(e) = inner.map.remove(id) {
            inner.bytes -= e.size;
        }
        None
    }

    /// Remembers a completion read under `ticket`, unless the key was
    /// invalidated since. `now` is the database's clock at the time
    /// `expires_at` was read, so the remaining lifetime is measured on one
    /// clock.
    pub fn put(&self, record: &RecordKey, cached: Cached, now: SystemTime, ticket: Ticket) {
        let (tenant, key) = (&record.tenant, &record.key);
        let size = size_of(
            tenant.as_str(),
            key.as_str(),
            &cached.response,
            cached.seen.as_ref(),
        );
        if self.max_bytes == 0 || size > self.max_bytes / 4 {
            // One entry may not crowd out the rest.
            return;
        }
        let Ok(remaining) = cached.expires_at.duration_since(now) else {
            return;
        };
        let until = Instant::now() + remaining.min(self.ttl);
        let id = record.id().to_string();
        let mut inner = self.lock();
        let stale = ticket.at.elapsed() >= self.window
            || ticket.epoch < inner.cleared
            || inner
                .invalidated
                .get(&id)
                .is_some_and(|&e| e > ticket.epoch);
        if stale {
            return;
        }
        inner.generation += 1;
        let generation = inner.generation;
        if let Some(old) = inner.map.insert(
            id.clone(),
            Entry {
                tenant: tenant.as_str().to_owned(),
                key: key.as_str().to_owned(),
                cached: Arc::new(cached),
                until,
                size,
                generation,
            },
        ) {
            inner.bytes -= old.size;
        }
        inner.bytes += size;
        inner.order.push_back((id, generation));
        while inner.bytes > self.max_bytes {
            let Some((oldest, gen)) = inner.order.pop_front() else {
                break;
            };
            // Skip queue entries of keys re-inserted or removed since.
            if inner.map.get(&oldest).is_some_and(|e| e.generation == gen) {
                if let Some(e) = inner.map.remove(&oldest) {
                    inner.bytes -= e.size;
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Keep the queue from growing without bound on re-insertions.
        if inner.order.len() > inner.map.len() * 2 + 64 {
            let Inner { map, order, .. } = &mut *inner;
            order.retain(|(id, gen)| map.get(id).is_some_and(|e| e.generation == *gen));
        }
    }

    /// Drops the entry of a key id (its record changed elsewhere), and
    /// keeps reads that started before from putting it back.
    pub fn invalidate(&self, id: &str) {
        if self.max_bytes == 0 {
            return;
        }
        let now = Instant::now();
        let mut inner = self.lock();
        if let Some(e) = inner.map.remove(id) {
            inner.bytes -= e.size;
        }
        inner.epoch += 1;
        let epoch = inner.epoch;
        inner.invalidated.insert(id.to_owned(), epoch);
        inner.invalidations.push_back((id.to_owned(), epoch, now));
        // Forget invalidations no live ticket can predate.
        while let Some((old, e, at)) = inner.invalidations.front() {
            if now.duration_since(*at) < self.window {
                break;
            }
            if inner.invalidated.get(old) == Some(e) {
                let old = old.clone();
                inner.invalidated.remove(&old);
            }
            inner.invalidations.pop_front();
        }
    }

    /// Drops everything (changes may have been missed), and keeps reads
    /// that started before from putting anything back.
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.map.clear();
        inner.order.clear();
        inner.bytes = 0;
        inner.epoch += 1;
        inner.cleared = inner.epoch;
    }

    /// Whether it may hold anything (a budget above 0).
    pub fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its counts since start and what it holds now, for the metrics.
    pub fn sample(&self) -> CacheSample {
        let (bytes, entries) = {
            let inner = self.lock();
            (inner.bytes as u64, inner.map.len() as u64)
        };
        CacheSample {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes,
            entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::{IdempotencyKey, KeyId, TenantId};
    use bytes::Bytes;

    const WINDOW: Duration = Duration::from_secs(2);

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s.as_bytes(), 255).unwrap()
    }

    fn rk(tenant: &TenantId, k: &str) -> RecordKey {
        RecordKey::new(tenant.clone(), key(k))
    }

    fn cached(body: usize, expires_in: Duration, now: SystemTime) -> Cached {
        Cached {
            fingerprint: Fingerprint::from_bytes(&[1; 32]).unwrap(),
            response: Arc::new(StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
                body: Some(Bytes::from(vec![b'x'; body])),
            }),
            expires_at: now + expires_in,
            headers: http::HeaderMap::new(),
            seen: None,
        }
    }

    #[test]
    fn a_cached_completion_is_returned_until_its_ttl() {
        let c = ResponseCache::new(1 << 20, Duration::from_millis(50), WINDOW);
        let now = SystemTime::now();
        let t = TenantId::from_stored("acme");
        c.put(
            &rk(&t, "k"),
            cached(10, Duration::from_secs(60), now),
            now,
            c.ticket(),
        );
        assert!(c.get(&rk(&t, "k")).is_some());
        assert!(
            c.get(&rk(&TenantId::from_stored("other"), "k")).is_none(),
            "tenants are separate"
        );
        std::thread::sleep(Duration::from_millis(60));
        assert!(c.get(&rk(&t, "k")).is_none());
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn an_entry_never_outlives_its_record() {
        let c = ResponseCache::new(1 << 20, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        let t = TenantId::none();
        c.put(
            &rk(&t, "k"),
            cached(10, Duration::from_millis(30), now),
            now,
            c.ticket(),
        );
        assert!(c.get(&rk(&t, "k")).is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(c.get(&rk(&t, "k")).is_none());
        // Already expired: not even stored.
        c.put(
            &rk(&t, "old"),
            cached(10, Duration::ZERO, now),
            now + Duration::from_secs(1),
            c.ticket(),
        );
        assert!(c.get(&rk(&t, "old")).is_none());
    }

    #[test]
    fn the_byte_budget_evicts_oldest_first() {
        let c = ResponseCache::new(16 * 1024, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        let t = TenantId::none();
        for i in 0..40 {
            c.put(
                &rk(&t, &format!("k{i}")),
                cached(500, Duration::from_secs(60), now),
                now,
                c.ticket(),
            );
            assert!(c.bytes() <= 16 * 1024);
        }
        assert!(c.get(&rk(&t, "k39")).is_some());
        assert!(c.get(&rk(&t, "k0")).is_none());
        let s = c.sample();
        assert_eq!((s.hits, s.misses), (1, 1));
        assert_eq!(s.entries + s.evictions, 40, "{s:?}");
        assert!(s.evictions > 0 && s.bytes == c.bytes() as u64, "{s:?}");
        // An entry larger than a quarter of the budget is not kept.
        c.put(
            &rk(&t, "big"),
            cached(5000, Duration::from_secs(60), now),
            now,
            c.ticket(),
        );
        assert!(c.get(&rk(&t, "big")).is_none());
    }

    #[test]
    fn a_requests_kept_inputs_count_against_the_budget() {
        let c = ResponseCache::new(1 << 20, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        let t = TenantId::none();
        c.put(
            &rk(&t, "bare"),
            cached(10, Duration::from_secs(60), now),
            now,
            c.ticket(),
        );
        let bare = c.bytes();
        let body = vec![b'{'; 4000];
        let seen = Inputs::new(
            crate::idempotency::FingerprintMode::Json,
            "POST",
            "/v1/p",
            None,
            Some(b"application/json"),
            &body,
        );
        let mut with = cached(10, Duration::from_secs(60), now);
        with.seen = Some(seen);
        c.put(&rk(&t, "with"), with, now, c.ticket());
        assert!(
            c.bytes() - bare >= bare + 4000,
            "{} then {}",
            bare,
            c.bytes()
        );
        let hit = c.get(&rk(&t, "with")).unwrap();
        assert_eq!(hit.seen.as_ref().unwrap().held_bytes(), 4000 + 4 + 5 + 16);
    }

    #[test]
    fn invalidation_by_key_id_drops_the_entry() {
        let c = ResponseCache::new(1 << 20, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        let t = TenantId::from_stored("acme");
        c.put(
            &rk(&t, "k"),
            cached(10, Duration::from_secs(60), now),
            now,
            c.ticket(),
        );
        c.invalidate(&KeyId::new(&t, &key("k")).to_string());
        assert!(c.get(&rk(&t, "k")).is_none());
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn a_release_that_lands_between_a_read_and_its_put_wins() {
        let c = ResponseCache::new(1 << 20, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        let t = TenantId::from_stored("acme");
        // The replay reads the record…
        let ticket = c.ticket();
        // …an operator's release commits and its notification arrives…
        c.invalidate(&KeyId::new(&t, &key("k")).to_string());
        // …then the replay caches what it read: refused.
        c.put(
            &rk(&t, "k"),
            cached(10, Duration::from_secs(60), now),
            now,
            ticket,
        );
        assert!(c.get(&rk(&t, "k")).is_none());
        // Other keys, and reads that start after the release, still cache.
        c.put(
            &rk(&t, "other"),
            cached(10, Duration::from_secs(60), now),
            now,
            ticket,
        );
        assert!(c.get(&rk(&t, "other")).is_some());
        c.put(
            &rk(&t, "k"),
            cached(10, Duration::from_secs(60), now),
            now,
            c.ticket(),
        );
        assert!(c.get(&rk(&t, "k")).is_some());
    }

    #[test]
    fn a_clear_refuses_every_read_that_started_before_it() {
        let c = ResponseCache::new(1 << 20, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        let ticket = c.ticket();
        c.clear();
        c.put(
            &rk(&TenantId::none(), "k"),
            cached(10, Duration::from_secs(60), now),
            now,
            ticket,
        );
        assert!(c.is_empty());
    }

    #[test]
    fn a_ticket_older_than_the_window_is_refused() {
        let c = ResponseCache::new(1 << 20, Duration::from_secs(60), Duration::from_millis(20));
        let now = SystemTime::now();
        let ticket = c.ticket();
        std::thread::sleep(Duration::from_millis(30));
        c.put(
            &rk(&TenantId::none(), "k"),
            cached(10, Duration::from_secs(60), now),
            now,
            ticket,
        );
        assert!(c.is_empty());
    }

    #[test]
    fn a_zero_budget_holds_nothing() {
        let c = ResponseCache::new(0, Duration::from_secs(60), WINDOW);
        let now = SystemTime::now();
        c.put(
            &rk(&TenantId::none(), "k"),
            cached(1, Duration::from_secs(60), now),
            now,
            c.ticket(),
        );
        assert!(c.is_empty());
    }
}
