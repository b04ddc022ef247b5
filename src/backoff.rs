//! Capped exponential backoff, for the loops that retry until the store
//! comes back (migrations at start, the key listener, a completion that
//! could not be stored).

use std::time::Duration;

/// Delays that double from `first` up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `first`, never waits longer than `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            next: first,
        }
    }

    /// The delay the next [`wait`](Self::wait) will sleep.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Sleeps the next delay, then doubles it (up to the cap).
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }

    /// Back to the first delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn delays_double_up_to_the_cap_and_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(b.peek());
            let t = tokio::time::Instant::now();
            b.wait().await;
            assert_eq!(t.elapsed(), seen[seen.len() - 1]);
        }
        assert_eq!(
            seen,
            [100, 200, 350, 350].map(Duration::from_millis).to_vec()
        );
        b.reset();
        assert_eq!(b.peek(), Duration::from_millis(100));
    }
}
