//! The fault driver: kills, pauses (past the lease and short), SIGTERM
//! restarts and upstream slowdowns on a seeded schedule, each healed by
//! the end of the run.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Clock, Fault, FaultKind, Replica, Settings};
use crate::support::proxy_proc::ProxyProc;
use crate::support::rng::Rng;
use crate::support::slowlink::SlowLink;

pub(super) async fn driver(
    replicas: Vec<Replica>,
    link: Arc<SlowLink>,
    settings: Settings,
    clock: Arc<Clock>,
    deadline_ms: u64,
    faults: Arc<Mutex<Vec<Fault>>>,
) -> (u32, Vec<tokio::task::JoinHandle<()>>) {
    let mut rng = Rng::new(settings.seed ^ 0x0D12_17E5);
    let lease_ms = settings.lease.as_millis() as u64;
    let mut slowdowns = 0;
    let mut tasks = Vec::new();
    // Let the traffic start first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while clock.ms() < deadline_ms {
        // Every draw is made on every turn, so the schedule of intended
        // faults depends on the seed alone; whether one is skipped (its
        // replica still busy with the previous fault) depends on timing.
        let wait = rng.range(250, 900);
        let roll = rng.range(0, 100);
        let i = rng.pick(replicas.len());
        let delay = Duration::from_millis(rng.range(150, 700));
        let lasting = Duration::from_millis(rng.range(500, 2500));
        let kill_hold = rng.range(100, 800);
        let long_hold = rng.range(lease_ms * 12 / 10, lease_ms * 5 / 2);
        let short_hold = rng.range(20, lease_ms / 8);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        if roll < 20 {
            slowdowns += 1;
            let link = link.clone();
            tasks.push(tokio::spawn(async move {
                link.set_delay(delay);
                tokio::time::sleep(lasting).await;
                link.set_delay(Duration::ZERO);
            }));
            continue;
        }
        // One replica always stays untouched.
        let busy = replicas.iter().filter(|r| r.try_lock().is_err()).count();
        if busy + 1 >= replicas.len() {
            continue;
        }
        let Ok(guard) = replicas[i].clone().try_lock_owned() else {
            continue;
        };
        let (kind, hold) = match roll {
            40..=54 if settings.sigterm => (FaultKind::Term, kill_hold),
            20..=54 => (FaultKind::Kill, kill_hold),
            55..=84 => (FaultKind::LongPause, long_hold),
            _ => (FaultKind::ShortPause, short_hold),
        };
        let clock = clock.clone();
        let faults = faults.clone();
        tasks.push(tokio::spawn(async move {
            let mut p = guard;
            let start_ms = clock.ms();
            let exit = inject(&mut p, kind, hold).await;
            faults.lock().unwrap().push(Fault {
                replica: i,
                kind,
                start_ms,
                end_ms: clock.ms(),
                exit,
            });
        }));
    }
    (slowdowns, tasks)
}

/// Injects one fault and heals it (the replica is up again at the end).
async fn inject(p: &mut ProxyProc, kind: FaultKind, hold: u64) -> Option<String> {
    match kind {
        FaultKind::Kill => {
            p.proc.kill();
            tokio::time::sleep(Duration::from_millis(hold)).await;
            p.proc.spawn(false);
            p.wait_ready(Duration::from_secs(20)).await;
            None
        }
        FaultKind::LongPause | FaultKind::ShortPause => {
            p.proc.pause();
            tokio::time::sleep(Duration::from_millis(hold)).await;
            p.proc.resume();
            None
        }
        FaultKind::Term => {
            p.proc.signal("TERM");
            // The grace of the fleet run's replicas, and a second to exit.
            let exit = p.proc.wait_exit(Duration::from_secs(12)).await;
            let text = match exit {
                Some(status) => Some(status.to_string()),
                None => {
                    p.proc.kill();
                    None
                }
            };
            p.proc.spawn(false);
            p.wait_ready(Duration::from_secs(20)).await;
            text
        }
    }
}

/// A rolling restart: SIGTERM, drain, start again, one replica after the
/// other (each waits for the replica's previous fault to end).
pub(super) async fn rolling_restart(
    replicas: Vec<Replica>,
    clock: Arc<Clock>,
    at_ms: u64,
    faults: Arc<Mutex<Vec<Fault>>>,
) {
    tokio::time::sleep(Duration::from_millis(at_ms.saturating_sub(clock.ms()))).await;
    for (i, r) in replicas.iter().enumerate() {
        let mut p = r.lock().await;
        let start_ms = clock.ms();
        let exit = inject(&mut p, FaultKind::Term, 0).await;
        faults.lock().unwrap().push(Fault {
            replica: i,
            kind: FaultKind::Term,
            start_ms,
            end_ms: clock.ms(),
            exit,
        });
    }
}
