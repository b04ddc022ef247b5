//! Timers cheap enough to arm on every request.
//!
//! Every request arms deadlines: hyper's bound on reading the next request
//! head, the upstream exchange's, a keyed body's read. A fresh tokio timer
//! costs a lock of the runtime's timer driver when it is first polled (it
//! is filed in the driver's wheel) and another when it is dropped (taken
//! out), and whenever the new deadline is earlier than the one the driver
//! last went to sleep for, a write to the driver's eventfd to wake it. On
//! a busy worker that write came about every other pass-through request
//! (`bench/syscalls`; BENCHMARKS.md, "Sixth pass"). A timer that is already filed and is moved
//! to a *later* deadline costs one compare-and-swap instead: the wheel
//! notices when the old deadline comes, and files it again. Request
//! deadlines only ever move later, so each thread keeps the timers its
//! requests are done with and [`sleep_until`] hands them out again, still
//! filed.
//!
//! A spare timer belongs to the runtime whose driver files it, so spares
//! are kept only on threads bound to one runtime for the rest of their
//! life ([`bind_thread`]: the workers); elsewhere (the main runtime, tests)
//! a timer is tokio's, used once. A spare is parked with a no-op waker, so
//! it keeps no finished task alive; if it sits unused past its old
//! deadline it fires, which wakes nobody, and it is filed again when next
//! used.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

/// The most spare timers a thread keeps: enough for the requests that end
/// between two that start on a busy worker; beyond it, a timer is dropped.
const MAX_SPARE: usize = 64;

thread_local! {
    static BOUND: Cell<bool> = const { Cell::new(false) };
    static SPARE: RefCell<Vec<Pin<Box<Sleep>>>> = const { RefCell::new(Vec::new()) };
}

/// Lets this thread keep spare timers. Only for a thread that runs one
/// runtime, and only that one, from now until it ends (a worker): a spare
/// can only be filed again by the driver that made it.
pub fn bind_thread() {
    BOUND.with(|b| b.set(true));
}

/// A timer from [`sleep_until`]: a future that completes at its deadline.
/// Dropped, it goes back to its thread's spares.
#[derive(Debug)]
pub struct RecycledSleep {
    /// `None` only while being dropped.
    sleep: Option<Pin<Box<Sleep>>>,
    /// Whether it was polled since it was handed out (its waker is then a
    /// task's, to be replaced before it is kept as a spare).
    polled: bool,
    /// Whether it is filed in the wheel (it was a spare, or was polled).
    /// One never filed is not kept: moving it would file it, a cost that a
    /// future ready at once should not pay.
    filed: bool,
    /// The spares of the bound thread it was made on (their address), or 0:
    /// it is kept only if dropped there (its runtime's).
    home: usize,
}

/// A timer that completes at `deadline`: a spare of this thread's, moved
/// to `deadline`, when there is one. Must be called within a tokio runtime
/// with its timer enabled (as [`tokio::time::sleep_until`]).
pub fn sleep_until(deadline: Instant) -> RecycledSleep {
    let (home, spare) = if BOUND.with(Cell::get) {
        SPARE
            .try_with(|spare| {
                let sleep = spare.try_borrow_mut().ok().and_then(|mut s| s.pop());
                (address(spare), sleep)
            })
            .unwrap_or((0, None))
    } else {
        (0, None)
    };
    let filed = spare.is_some();
    let sleep = match spare {
        Some(mut sleep) => {
            sleep.as_mut().reset(deadline);
            sleep
        }
        // Filed when first polled, as any tokio timer.
        None => Box::pin(tokio::time::sleep_until(deadline)),
    };
    RecycledSleep {
        sleep: Some(sleep),
        polled: false,
        filed,
        home,
    }
}

fn address(spare: &RefCell<Vec<Pin<Box<Sleep>>>>) -> usize {
    spare as *const _ as usize
}

impl RecycledSleep {
    /// Moves the deadline (cheaply when it moves later).
    pub fn reset(&mut self, deadline: Instant) {
        if let Some(sleep) = self.sleep.as_mut() {
            sleep.as_mut().reset(deadline);
        }
    }
}

impl Future for RecycledSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.polled = true;
        self.filed = true;
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Drop for RecycledSleep {
    fn drop(&mut self) {
        if self.home == 0 || !self.filed {
            return;
        }
        let Some(mut sleep) = self.sleep.take() else {
            return;
        };
        if self.polled {
            // The task's waker gives way to a no-op one; the timer stays
            // filed. (A task out of budget gets Pending back with its
            // waker kept, until the timer fires or serves again.)
            let _ = sleep.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        }
        let home = self.home;
        let _ = SPARE.try_with(move |spare| {
            if address(spare) != home {
                return;
            }
            if let Ok(mut spare) = spare.try_borrow_mut() {
                if spare.len() < MAX_SPARE {
                    spare.push(sleep);
                }
            }
        });
    }
}

/// The error of [`Timeout`]: the deadline passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

pin_project! {
    /// `future`, unless its deadline passes first: [`tokio::time::Timeout`]
    /// with a timer from [`sleep_until`]. The future is polled first, so
    /// one ready at once never files a timer.
    #[derive(Debug)]
    #[must_use = "futures do nothing unless polled"]
    pub struct Timeout<F> {
        #[pin]
        future: F,
        sleep: RecycledSleep,
    }
}

/// `future`, unless `duration` passes first.
pub fn timeout<F: Future>(duration: Duration, future: F) -> Timeout<F> {
    timeout_at(Instant::now() + duration, future)
}

/// `future`, unless `deadline` passes first.
pub fn timeout_at<F: Future>(deadline: Instant, future: F) -> Timeout<F> {
    Timeout {
        future,
        sleep: sleep_until(deadline),
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.future.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        Pin::new(this.sleep).poll(cx).map(|()| Err(Elapsed))
    }
}

/// hyper's timer, over [`sleep_until`]: the server's bound on reading a
/// request head is armed for every request on a connection.
#[derive(Debug, Clone, Copy, Default)]
pub struct HyperTimer;

impl hyper::rt::Sleep for RecycledSleep {}

impl hyper::rt::Timer for HyperTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(sleep_until(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(sleep_until(deadline.into()))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: std::time::Instant) {
        match sleep.as_mut().downcast_mut_pin::<RecycledSleep>() {
            Some(mut ours) => ours.reset(new_deadline.into()),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

#[cfg(test)]
mod tests;
