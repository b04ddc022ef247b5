//! `[sweeper]`: the background deletion of expired records.

use super::Checker;
use crate::config::raw::RawSweeper;
use crate::config::{rules, SweeperConfig};

impl Checker<'_> {
    pub(super) fn sweeper(
        &mut self,
        raw: &RawSweeper,
        base: Option<&SweeperConfig>,
    ) -> Option<SweeperConfig> {
        let interval = get!(self, sweeper.interval, raw, base, rules::positive_duration);
        let batch_size = get!(self, sweeper.batch_size, raw, base, |&n| {
            rules::int_in(n, 1..=i64::from(u32::MAX))
                .and_then(|n| u32::try_from(n).map_err(|err| err.to_string()))
        });
        let pause = get!(self, sweeper.pause, raw, base, rules::duration);
        Some(SweeperConfig {
            interval: interval?,
            batch_size: batch_size?,
            pause: pause?,
        })
    }
}
