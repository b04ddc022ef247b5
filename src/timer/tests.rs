use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Wake;

use hyper::rt::Timer as _;

use super::*;

const MS: Duration = Duration::from_millis(1);

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

/// Where a timer's tokio Sleep lives: the same address means the same timer.
fn address_of(s: &RecycledSleep) -> *const Sleep {
    &**s.sleep.as_ref().unwrap() as *const Sleep
}

fn spares() -> usize {
    SPARE.with(|s| s.borrow().len())
}

// Each test runs on a thread of its own, with a runtime of its own: binding
// that thread is what a worker does.

#[tokio::test(start_paused = true)]
async fn a_timer_reused_later_fires_at_its_new_deadline_not_its_old() {
    bind_thread();
    let mut s = sleep_until(Instant::now() + 100 * MS);
    assert!(
        poll_once(&mut s).is_pending(),
        "filed in the wheel at +100 ms"
    );
    let old = address_of(&s);
    drop(s);
    assert_eq!(spares(), 1);

    let start = Instant::now();
    let s = sleep_until(start + 300 * MS);
    assert_eq!(address_of(&s), old, "the spare is handed out again");
    s.await;
    // The wheel reached the old deadline first and filed it again.
    assert_eq!(start.elapsed(), 300 * MS);
}

#[tokio::test(start_paused = true)]
async fn a_timer_reused_earlier_fires_at_its_new_deadline() {
    bind_thread();
    let mut s = sleep_until(Instant::now() + 500 * MS);
    assert!(poll_once(&mut s).is_pending());
    let old = address_of(&s);
    drop(s);

    let start = Instant::now();
    let s = sleep_until(start + 50 * MS);
    assert_eq!(address_of(&s), old);
    s.await;
    assert_eq!(start.elapsed(), 50 * MS);
}

#[tokio::test(start_paused = true)]
async fn a_spare_that_fired_unused_serves_again() {
    bind_thread();
    let mut s = sleep_until(Instant::now() + 10 * MS);
    assert!(poll_once(&mut s).is_pending());
    let old = address_of(&s);
    drop(s);
    // Its old deadline passes while it is spare: it fires, waking nobody.
    tokio::time::sleep(50 * MS).await;

    let start = Instant::now();
    let mut s = sleep_until(start + 100 * MS);
    assert_eq!(address_of(&s), old);
    assert!(poll_once(&mut s).is_pending(), "not still fired");
    s.await;
    assert_eq!(start.elapsed(), 100 * MS);
}

#[tokio::test(start_paused = true)]
async fn a_spare_keeps_no_task_alive() {
    struct Task(AtomicUsize);
    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    bind_thread();
    let task = Arc::new(Task(AtomicUsize::new(0)));
    let waker = Waker::from(task.clone());
    let mut s = sleep_until(Instant::now() + 10 * MS);
    assert!(Pin::new(&mut s)
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    drop(waker);
    assert_eq!(
        Arc::strong_count(&task),
        2,
        "the filed timer holds the waker"
    );
    drop(s);
    assert_eq!(spares(), 1);
    assert_eq!(Arc::strong_count(&task), 1, "the spare let it go");
    tokio::time::sleep(50 * MS).await;
    assert_eq!(
        task.0.load(Ordering::SeqCst),
        0,
        "the spare fired, waking nobody"
    );
}

#[tokio::test(start_paused = true)]
async fn a_thread_keeps_a_bounded_number_of_spares() {
    bind_thread();
    let deadline = Instant::now() + 10 * MS;
    let mut all: Vec<_> = (0..MAX_SPARE + 10).map(|_| sleep_until(deadline)).collect();
    for s in &mut all {
        assert!(poll_once(s).is_pending());
    }
    drop(all);
    assert_eq!(spares(), MAX_SPARE);
}

#[tokio::test(start_paused = true)]
async fn a_timer_never_polled_is_not_kept() {
    bind_thread();
    drop(sleep_until(Instant::now() + 10 * MS));
    assert_eq!(timeout(10 * MS, async { 5 }).await, Ok(5));
    assert_eq!(spares(), 0, "a future ready at once files no timer");
}

#[tokio::test(start_paused = true)]
async fn an_unbound_thread_keeps_no_spares() {
    let mut s = sleep_until(Instant::now() + 10 * MS);
    assert!(poll_once(&mut s).is_pending());
    drop(s);
    assert_eq!(spares(), 0);
    // Nor does a bound thread keep a timer made on another thread.
    let other = std::thread::spawn({
        let handle = tokio::runtime::Handle::current();
        move || {
            let _enter = handle.enter();
            bind_thread();
            let mut s = sleep_until(Instant::now() + 10 * MS);
            assert!(poll_once(&mut s).is_pending());
            s
        }
    })
    .join()
    .unwrap();
    bind_thread();
    drop(other);
    assert_eq!(spares(), 0);
}

#[tokio::test(start_paused = true)]
async fn timeout_gives_the_output_or_elapsed() {
    bind_thread();
    let start = Instant::now();
    assert_eq!(timeout(10 * MS, tokio::time::sleep(5 * MS)).await, Ok(()));
    assert_eq!(start.elapsed(), 5 * MS);

    let start = Instant::now();
    assert_eq!(
        timeout(10 * MS, std::future::pending::<()>()).await,
        Err(Elapsed)
    );
    assert_eq!(start.elapsed(), 10 * MS);

    // Again, on the timer the last one left.
    let start = Instant::now();
    assert_eq!(
        timeout_at(start + 30 * MS, std::future::pending::<()>()).await,
        Err(Elapsed)
    );
    assert_eq!(start.elapsed(), 30 * MS);
    assert_eq!(spares(), 1);
}

#[tokio::test(start_paused = true)]
async fn hyper_timer_sleeps_and_resets_its_own_timers() {
    bind_thread();
    let start = Instant::now();
    let mut s = HyperTimer.sleep(100 * MS);
    assert!(poll_once(&mut s).is_pending());
    HyperTimer.reset(&mut s, (start + 250 * MS).into_std());
    assert!(
        s.as_mut().downcast_mut_pin::<RecycledSleep>().is_some(),
        "reset in place, not replaced"
    );
    s.await;
    assert_eq!(start.elapsed(), 250 * MS);

    let start = Instant::now();
    HyperTimer.sleep_until((start + 40 * MS).into_std()).await;
    assert_eq!(start.elapsed(), 40 * MS);
}
