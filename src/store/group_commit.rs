//! Application-level group commit.
//!
//! A durable "execute once" needs a commit for the claim and one for the
//! result, and on this hardware the commit flush dominates. Claims (and,
//! separately, completions) that arrive while earlier ones are at the
//! database are therefore sent together: N concurrent new keys cost one
//! round trip and one commit instead of N.
//!
//! There is no waiting window. A worker takes whatever is queued the moment
//! it is free, and while its batch is at the database the next requests
//! queue up and form the next batch. A few workers run at once so that a
//! slow batch does not stall the others.
//!
//! A lone item goes straight to the database. When no other item of this
//! kind is waiting for its answer (none queued, none at the database), the
//! caller runs its item itself, in its own task, instead of handing it to a
//! worker through a channel and waiting for the answer through another:
//! there is no company to wait for, and each hand-off between tasks is a
//! wake-up (often of another thread) on the path of every request. Items
//! arriving meanwhile are not alone: they queue up and batch as before, so
//! under load nothing changes.
//!
//! Per-key atomicity and fencing are untouched: every row of a batch is the
//! same fenced statement as before, only sent together. Rows are processed
//! in `(tenant, key)` order, so two batches never wait for each other's
//! rows in opposite orders (no deadlocks).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use super::StoreError;

type Reply<O> = oneshot::Sender<Result<O, StoreError>>;

/// A batch's execution, shared by the workers and the direct path.
type Exec<I, O> = dyn Fn(Vec<I>) -> Pin<Box<dyn Future<Output = Result<Vec<O>, StoreError>> + Send>>
    + Send
    + Sync;

/// Counters of one batcher, for the metrics.
#[derive(Debug, Default)]
pub struct BatchStats {
    /// Statements (batches) sent.
    pub batches: AtomicU64,
    /// Items carried by them.
    pub items: AtomicU64,
    /// Largest batch so far.
    pub largest: AtomicU64,
}

/// Queues items of one kind and executes them in batches.
pub struct Batcher<I, O> {
    tx: mpsc::UnboundedSender<(I, Reply<O>)>,
    stats: Arc<BatchStats>,
    exec: Arc<Exec<I, O>>,
    /// Items submitted and not yet answered (queued or at the database).
    pending: AtomicUsize,
}

/// One item counted in `pending` until its caller has its answer or gives
/// up (the guard is dropped with the caller's future).
struct Pending<'a>(&'a AtomicUsize);

impl<'a> Pending<'a> {
    /// Counts an item in; `true` if no other item was pending.
    fn enter(pending: &'a AtomicUsize) -> (Self, bool) {
        let before = pending.fetch_add(1, Ordering::AcqRel);
        (Pending(pending), before == 0)
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl BatchStats {
    fn count(&self, n: usize) {
        let n = n as u64;
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.items.fetch_add(n, Ordering::Relaxed);
        self.largest.fetch_max(n, Ordering::Relaxed);
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts `workers` tasks that each execute up to `max_batch` queued
    /// items at a time with `exec`, which returns one output per item, in
    /// order. Must be called inside a tokio runtime.
    pub fn start<F, Fut>(workers: usize, max_batch: usize, exec: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<O>, StoreError>> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel::<(I, Reply<O>)>();
        let rx = Arc::new(Mutex::new(rx));
        let exec: Arc<Exec<I, O>> = Arc::new(move |items| Box::pin(exec(items)));
        let stats = Arc::new(BatchStats::default());
        for _ in 0..workers.max(1) {
            let (rx, exec, stats) = (rx.clone(), exec.clone(), stats.clone());
            tokio::spawn(async move {
                loop {
                    let mut batch = Vec::new();
                    {
                        // One worker at a time collects; the others are at
                        // the database or waiting their turn.
                        let mut rx = rx.lock().await;
                        match rx.recv().await {
                            Some(first) => batch.push(first),
                            None => return,
                        }
                        while batch.len() < max_batch {
                            match rx.try_recv() {
                                Ok(next) => batch.push(next),
                                Err(_) => break,
                            }
                        }
                    }
                    // Requests that gave up (timed out) need no work.
                    batch.retain(|(_, reply)| !reply.is_closed());
                    if batch.is_empty() {
                        continue;
                    }
                    stats.count(batch.len());
                    let (items, replies): (Vec<I>, Vec<Reply<O>>) = batch.into_iter().unzip();
                    match exec(items).await {
                        Ok(outputs) if outputs.len() == replies.len() => {
                            for (reply, out) in replies.into_iter().zip(outputs) {
                                let _ = reply.send(Ok(out));
                            }
                        }
                        Ok(outputs) => {
                            let e = StoreError::Corrupt(format!(
                                "a batch of {} returned {} results",
                                replies.len(),
                                outputs.len()
                            ));
                            for reply in replies {
                                let _ = reply.send(Err(e.clone()));
                            }
                        }
                        Err(e) => {
                            for reply in replies {
                                let _ = reply.send(Err(e.clone()));
                            }
                        }
                    }
                }
            });
        }
        Batcher {
            tx,
            stats,
            exec,
            pending: AtomicUsize::new(0),
        }
    }

    /// Runs one item: at once in the caller's task when it is alone (see
    /// the module docs), else queued for the next batch.
    pub async fn submit(&self, item: I) -> Result<O, StoreError> {
        let (_pending, alone) = Pending::enter(&self.pending);
        if alone {
            self.stats.count(1);
            let mut outputs = (self.exec)(vec![item]).await?;
            return match (outputs.pop(), outputs.is_empty()) {
                (Some(out), true) => Ok(out),
                (out, _) => Err(StoreError::Corrupt(format!(
                    "a batch of 1 returned {} results",
                    outputs.len() + usize::from(out.is_some())
                ))),
            };
        }
        let (reply, rx) = oneshot::channel();
        self.tx
            .send((item, reply))
            .map_err(|_| StoreError::Pool("the store is shutting down".into()))?;
        rx.await
            .map_err(|_| StoreError::Pool("the batch worker stopped".into()))?
    }

    /// This batcher's counters.
    pub fn stats(&self) -> &BatchStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_lone_item_is_sent_at_once() {
        let b = Batcher::start(1, 8, |items: Vec<u32>| async move {
            Ok(items.into_iter().map(|i| i * 2).collect())
        });
        let out = tokio::time::timeout(Duration::from_millis(100), b.submit(21))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(out, 42);
        assert_eq!(b.stats().batches.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_lone_item_runs_in_its_callers_task() {
        let b = Arc::new(Batcher::start(1, 8, |items: Vec<u32>| async move {
            Ok(items.into_iter().map(|_| tokio::task::id()).collect())
        }));
        let caller = tokio::spawn({
            let b = b.clone();
            async move { (tokio::task::id(), b.submit(1).await.unwrap()) }
        });
        let (caller, ran_in) = caller.await.unwrap();
        assert_eq!(ran_in, caller, "no hand-off to a worker task");
        assert_eq!(b.stats().items.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn items_arriving_while_a_lone_item_runs_are_batched() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let b = Arc::new(Batcher::start(1, 64, {
            let gate = gate.clone();
            move |items: Vec<u32>| {
                let gate = gate.clone();
                async move {
                    if items == [0] {
                        // The lone first item stays at the "database" until
                        // the others have queued.
                        gate.notified().await;
                    }
                    Ok(items)
                }
            }
        }));
        let first = tokio::spawn({
            let b = b.clone();
            async move { b.submit(0).await.unwrap() }
        });
        tokio::task::yield_now().await;
        let rest: Vec<_> = (1..=10)
            .map(|i| {
                let b = b.clone();
                tokio::spawn(async move { b.submit(i).await.unwrap() })
            })
            .collect();
        for (i, t) in rest.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), i as u32 + 1);
        }
        gate.notify_one();
        assert_eq!(first.await.unwrap(), 0);
        let stats = b.stats();
        assert!(stats.largest.load(Ordering::Relaxed) > 1, "batched");
        assert!(stats.batches.load(Ordering::Relaxed) < 11);
        assert_eq!(stats.items.load(Ordering::Relaxed), 11);
    }

    #[tokio::test]
    async fn items_queued_while_a_batch_runs_form_the_next_batch() {
        let b = Arc::new(Batcher::start(1, 64, |items: Vec<u32>| async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(items)
        }));
        let mut tasks = Vec::new();
        for i in 0..20 {
            let b = b.clone();
            tasks.push(tokio::spawn(async move { b.submit(i).await.unwrap() }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(
                t.await.unwrap(),
                i as u32,
                "each caller gets its own output"
            );
        }
        let batches = b.stats().batches.load(Ordering::Relaxed);
        assert!(batches < 20, "batched: {batches} batches for 20 items");
        assert_eq!(b.stats().items.load(Ordering::Relaxed), 20);
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_item_in_it() {
        let b = Batcher::start(1, 8, |_: Vec<u32>| async move {
            Err::<Vec<u32>, _>(StoreError::Db("boom".into()))
        });
        assert!(matches!(b.submit(1).await, Err(StoreError::Db(_))));
    }

    #[tokio::test]
    async fn batches_never_exceed_the_maximum() {
        let b = Arc::new(Batcher::start(1, 4, |items: Vec<u32>| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(items)
        }));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let b = b.clone();
                tokio::spawn(async move { b.submit(i).await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert!(b.stats().largest.load(Ordering::Relaxed) <= 4);
    }
}
