//! The seeded chaos driver shared by `tests/chaos.rs` (replicas on one
//! database) and `tests/fleet_chaos.rs` (replicas through PgBouncer in
//! transaction mode on a small private cluster): clients that retry, a
//! driver that kills, pauses and SIGTERM-restarts replicas and slows the
//! upstream down, and the checker of the invariants. The invariants are
//! listed in `tests/chaos.rs` and in RELIABILITY.md.
//!
//! Besides the invariants, every `503 store-unavailable` a client receives
//! is attributed: to an injected fault when some fault (on any replica: a
//! paused one may hold a pooled server connection and its row locks) was
//! under way between one lease before the send and its answer; otherwise it
//! is a store error no fault explains, which the fleet run counts as a
//! failure.

//!
//! Layout: this file holds the settings, what a run records, and [`run`]
//! with the checker; `clients.rs` the retrying clients; `faults.rs` the
//! driver that injects the faults.

mod clients;
mod faults;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Mutex as AsyncMutex;

use super::http::HttpClient;
use super::proxy_proc::ProxyProc;
use super::rng::Rng;
use super::slowlink::SlowLink;
use super::upstream_proc::UpstreamProc;
use clients::{client, resolve};
use faults::{driver, rolling_restart};

#[derive(Debug, Clone)]
pub struct Settings {
    pub seed: u64,
    pub duration: Duration,
    pub clients: usize,
    pub replicas: usize,
    pub lease: Duration,
    /// How long a client waits for an answer before it retries elsewhere.
    pub client_timeout: Duration,
    /// Count a second execution by a live owner whose lease ran out (the
    /// known issue of RELIABILITY.md) as an anomaly too.
    pub strict: bool,
    /// SIGTERM faults too (drain, exit 0, restart), and one rolling restart
    /// of every replica a third of the way through. Off for the original
    /// chaos run, whose seeded schedule stays what it was.
    pub sigterm: bool,
}

/// What a run defaults to, before the environment.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub secs: u64,
    pub clients: u64,
    pub replicas: u64,
    pub lease_ms: u64,
    pub sigterm: bool,
}

impl Settings {
    /// `{prefix}_SEED`, `_SECS`, `_CLIENTS`, `_REPLICAS`, `_STRICT`
    /// override the defaults (e.g. `IDEMPROXY_CHAOS_SECS`).
    pub fn from_env(prefix: &str, d: Defaults) -> Settings {
        let num = |name: &str, default: u64| -> u64 {
            let name = format!("{prefix}_{name}");
            std::env::var(&name)
                .ok()
                .map(|v| {
                    v.parse()
                        .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
                })
                .unwrap_or(default)
        };
        Settings {
            seed: num("SEED", 20_261_202),
            duration: Duration::from_secs(num("SECS", d.secs)),
            clients: num("CLIENTS", d.clients) as usize,
            replicas: num("REPLICAS", d.replicas).max(2) as usize,
            lease: Duration::from_millis(d.lease_ms),
            client_timeout: Duration::from_millis(d.lease_ms * 12 / 10),
            strict: num("STRICT", 0) != 0,
            sigterm: d.sigterm,
        }
    }
}

// ---------------------------------------------------------------------------
// What happened, on one clock (milliseconds since the run started).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL, then a restart on the same ports.
    Kill,
    /// SIGSTOP … SIGCONT, longer than the lease.
    LongPause,
    /// SIGSTOP … SIGCONT, a fraction of the lease: must change nothing.
    ShortPause,
    /// SIGTERM: the replica drains (owned claims finish and are stored),
    /// exits 0 within its grace, and is started again on the same ports.
    /// Never an excuse for a second execution.
    Term,
}

#[derive(Debug, Clone)]
pub struct Fault {
    pub replica: usize,
    pub kind: FaultKind,
    pub start_ms: u64,
    pub end_ms: u64,
    /// For `Term`: how the process ended (`None`: it did not exit in time
    /// and was killed).
    pub exit: Option<String>,
}

#[derive(Debug, Clone)]
enum Outcome {
    Answer {
        status: u16,
        replayed: bool,
        /// The proxy's problem type (`request-in-progress`, …), if it is one.
        problem: Option<String>,
        body: Bytes,
    },
    /// Connection error or no answer within the client timeout.
    NoAnswer(String),
}

#[derive(Debug, Clone)]
struct SendRecord {
    replica: usize,
    start_ms: u64,
    end_ms: u64,
    outcome: Outcome,
}

/// Log lines of an owner that was alive when its lease ran out: its
/// completion failed or came too late, or its renewals did.
const OUTRUN_SIGNS: &[&str] = &[
    "could not store the response",
    "lease lost before the response could be stored",
    "lease lost: another attempt owns this key now",
    "lease lost while the upstream call is in flight",
];

/// Problems that mean "try again": nothing definitive happened for the client.
const RETRYABLE: &[&str] = &[
    "request-in-progress",
    "store-unavailable",
    "upstream-failed",
    "upstream-timeout",
    "upstream-unreachable",
];

impl Outcome {
    fn definitive(&self) -> bool {
        match self {
            Outcome::Answer { problem, .. } => {
                !problem.as_deref().is_some_and(|p| RETRYABLE.contains(&p))
            }
            Outcome::NoAnswer(_) => false,
        }
    }
}

#[derive(Debug, Clone)]
struct Intent {
    key: String,
    body: String,
    delay_ms: u64,
    sends: Vec<SendRecord>,
    /// When the client got its definitive answer.
    resolved_ms: Option<u64>,
}

pub struct Clock(pub Instant);

impl Clock {
    pub fn ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// A replica the driver may kill, pause or restart while clients use it.
pub type Replica = Arc<AsyncMutex<ProxyProc>>;

/// A record as stored: attempt, state, response status and body.
type StoredRow = (i32, String, Option<i16>, Option<Vec<u8>>);

// ---------------------------------------------------------------------------
// The run.

/// What a run found.
pub struct RunResult {
    /// The printed report (figures, then anomalies).
    pub report: String,
    pub anomalies: Vec<String>,
    pub faults: Vec<Fault>,
    pub intents: u64,
    /// `503 store-unavailable` answers during or just after a fault.
    pub store_errors_in_faults: u64,
    /// `503 store-unavailable` answers no fault explains.
    pub store_errors_unexplained: Vec<String>,
}

/// Runs the clients and the fault driver against `replicas` (started, in
/// front of `link`, which fronts `up`), then checks the invariants against
/// the upstream's counts and the records table (`sql`). `title` opens the
/// report.
pub async fn run(
    title: &str,
    settings: &Settings,
    replicas: Vec<Replica>,
    link: Arc<SlowLink>,
    up: &UpstreamProc,
    sql: &tokio_postgres::Client,
) -> RunResult {
    let settings = settings.clone();
    let run_started = Instant::now();
    let lease_ms = settings.lease.as_millis() as u64;
    let mut urls = Vec::new();
    for r in &replicas {
        urls.push(format!("http://{}", r.lock().await.listen));
    }
    let urls = Arc::new(urls);

    let clock = Arc::new(Clock(Instant::now()));
    let deadline_ms = settings.duration.as_millis() as u64;
    let faults = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..settings.clients)
        .map(|id| {
            tokio::spawn(client(
                id,
                urls.clone(),
                settings.clone(),
                clock.clone(),
                deadline_ms,
            ))
        })
        .collect();
    let rolling = settings.sigterm.then(|| {
        tokio::spawn(rolling_restart(
            replicas.clone(),
            clock.clone(),
            deadline_ms / 3,
            faults.clone(),
        ))
    });
    let (slowdowns, fault_tasks) = driver(
        replicas.clone(),
        link.clone(),
        settings.clone(),
        clock.clone(),
        deadline_ms,
        faults.clone(),
    )
    .await;

    // Heal: every fault ends (killed replicas are back, paused ones resumed).
    for t in fault_tasks {
        t.await.expect("a fault task failed");
    }
    if let Some(t) = rolling {
        t.await.expect("the rolling restart failed");
    }
    link.set_delay(Duration::ZERO);
    for r in &replicas {
        r.lock().await.wait_ready(Duration::from_secs(20)).await;
    }
    let mut intents = Vec::new();
    for c in clients {
        intents.extend(c.await.expect("a client failed"));
    }
    let traffic_ms = clock.ms();

    // (d), first half: past the lease nobody renews anything any more.
    tokio::time::sleep(settings.lease + Duration::from_millis(300)).await;
    let live_leases: i64 = sql
        .query_one(
            "SELECT count(*) FROM idempotency_records
              WHERE state = 'in_flight' AND lease_expires_at > now()",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    // Every intent a client gave up on gets its answer now, without faults.
    let http = HttpClient::new();
    let mut final_rng = Rng::new(settings.seed ^ 0xF1A1);
    let mut finished_late = 0;
    for intent in intents.iter_mut().filter(|i| i.resolved_ms.is_none()) {
        finished_late += 1;
        let mut extra = settings.clone();
        extra.client_timeout = Duration::from_secs(10);
        let limit = intent.sends.len() + 60;
        resolve(&http, &urls, intent, &mut final_rng, &extra, &clock, limit).await;
    }

    // (d), second half.
    let in_flight: i64 = sql
        .query_one(
            "SELECT count(*) FROM idempotency_records WHERE state = 'in_flight'",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    // The stored truth.
    let rows: HashMap<String, StoredRow> = sql
        .query(
            "SELECT idempotency_key, attempt, state, response_status, response_body
               FROM idempotency_records",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect();
    let stats = up.stats().await;
    let executions = |key: &str| stats["keys"][key].as_u64().unwrap_or(0);
    let faults = faults.lock().unwrap().clone();

    let mut replica_logs = Vec::new();
    for r in &replicas {
        replica_logs.push(r.lock().await.proc.log_text());
    }
    let logs = replica_logs.concat();

    let mut anomalies: Vec<String> = Vec::new();
    let mut lease_outrun: Vec<String> = Vec::new();
    let mut report = Report::default();
    for intent in &intents {
        report.intents += 1;
        report.sends += intent.sends.len() as u64;
        for s in &intent.sends {
            match &s.outcome {
                Outcome::NoAnswer(_) => report.no_answer += 1,
                Outcome::Answer {
                    problem: Some(p), ..
                } => *report.problems.entry(p.clone()).or_default() += 1,
                Outcome::Answer { replayed: true, .. } => report.replays += 1,
                Outcome::Answer { .. } => report.fresh_answers += 1,
            }
        }
        let key = &intent.key;
        let Some(resolved_ms) = intent.resolved_ms else {
            anomalies.push(format!("{key}: never got a definitive answer"));
            continue;
        };
        let Some((attempt, state, status, body)) = rows.get(key) else {
            anomalies.push(format!("{key}: answered but no record"));
            continue;
        };
        if state != "completed" {
            anomalies.push(format!("{key}: still {state}"));
            continue;
        }
        let exec = executions(key);
        let attempt = u64::try_from(*attempt).unwrap();
        report.executions += exec;
        report.takeovers += attempt - 1;
        if exec > 1 {
            report.keys_executed_twice += 1;
        }
        // (a)
        if exec == 0 || exec > attempt {
            anomalies.push(format!(
                "(a) {key}: {exec} executions, {} takeovers",
                attempt - 1
            ));
        }
        // (b): every execution after the first needs an earlier owner that
        // forwarded and then was killed, or paused past its lease, while it
        // held the key: a send that got no answer, to a replica whose fault
        // began after the send and before the client's answer. (A takeover
        // without a second execution is harmless: its earlier owner never
        // forwarded, e.g. a claim that committed after the proxy had given
        // up waiting for it and answered 503.)
        report.takeovers_without_execution += attempt.saturating_sub(exec);
        if exec > 1 {
            let faulted_by = |s: &SendRecord| {
                faults.iter().find(|f| {
                    f.replica == s.replica
                        && !matches!(f.kind, FaultKind::ShortPause | FaultKind::Term)
                        && f.start_ms >= s.start_ms
                        && f.start_ms <= resolved_ms
                })
            };
            let faulted: Vec<&Fault> = intent
                .sends
                .iter()
                .filter(|s| matches!(s.outcome, Outcome::NoAnswer(_)))
                .filter_map(faulted_by)
                .collect();
            if faulted.iter().any(|f| f.kind == FaultKind::Kill) {
                report.twice_after_kill += 1;
            } else if !faulted.is_empty() {
                report.twice_after_pause += 1;
            }
            if (faulted.len() as u64) < exec - 1 {
                let evidence = evidence(&replica_logs, key);
                let text = format!(
                    "(b) {key}: {exec} executions, {} takeovers, but {} unanswered sends to a \
                     replica then killed or paused past the lease: {:?}\n{}",
                    attempt - 1,
                    faulted.len(),
                    intent
                        .sends
                        .iter()
                        .map(|s| (s.replica, s.start_ms, brief(&s.outcome)))
                        .collect::<Vec<_>>(),
                    evidence.join("\n")
                );
                // The known issue of RELIABILITY.md: a live owner whose lease
                // ran out while it was storing its response (or while its
                // renewals could not reach a slow database). Its log says so.
                let outrun = evidence
                    .iter()
                    .any(|l| OUTRUN_SIGNS.iter().any(|sign| l.contains(sign)));
                if outrun && !settings.strict {
                    lease_outrun.push(text);
                } else {
                    anomalies.push(text);
                }
            }
        }
        // (c)
        let stored_status = status.map(|s| s as u16);
        let stored_body = body.as_deref().unwrap_or_default();
        let stored: serde_json::Value = serde_json::from_slice(stored_body).unwrap_or_default();
        // The sample upstream echoes the attempt as a string.
        let stored_attempt = stored["attempt"]
            .as_str()
            .and_then(|a| a.parse::<u64>().ok());
        if stored_attempt != Some(attempt) {
            anomalies.push(format!(
                "(c) {key}: stored response is from attempt {}, the record is at attempt {attempt}",
                stored["attempt"]
            ));
        }
        for s in &intent.sends {
            if let Outcome::Answer {
                status,
                replayed,
                problem: None,
                body,
            } = &s.outcome
            {
                let same = Some(*status) == stored_status && &body[..] == stored_body;
                if *replayed {
                    report.replays_checked += 1;
                    if !same {
                        anomalies.push(format!(
                            "(c) {key}: a replay differs from the stored response"
                        ));
                    }
                } else if !same {
                    // The answer of an owner fenced out by a takeover.
                    report.fenced_answers += 1;
                    if exec < 2 {
                        anomalies.push(format!(
                            "(c) {key}: an executed answer differs from the stored one, with one execution"
                        ));
                    }
                }
                if *status != 201 {
                    anomalies.push(format!("{key}: upstream status {status}"));
                }
            }
            if let Outcome::Answer {
                problem: Some(p),
                status,
                ..
            } = &s.outcome
            {
                if !RETRYABLE.contains(&p.as_str()) {
                    anomalies.push(format!("{key}: unexpected problem {status} {p}"));
                }
            }
        }
    }
    // Executions the upstream counted for keys no intent knows.
    let known: std::collections::HashSet<&str> = intents.iter().map(|i| i.key.as_str()).collect();
    if let Some(keys) = stats["keys"].as_object() {
        for k in keys.keys().filter(|k| !known.contains(k.as_str())) {
            anomalies.push(format!("unknown key executed: {k}"));
        }
    }
    if live_leases != 0 {
        anomalies.push(format!(
            "(d) {live_leases} leases still renewed after quiescing"
        ));
    }
    if in_flight != 0 {
        anomalies.push(format!("(d) {in_flight} records in flight at the end"));
    }

    // SIGTERM: every replica drained and exited 0 by itself.
    for f in faults.iter().filter(|f| f.kind == FaultKind::Term) {
        match &f.exit {
            Some(status) if status == "exit status: 0" => {}
            Some(status) => anomalies.push(format!(
                "replica-{} exited with {status} after SIGTERM at {} ms",
                f.replica, f.start_ms
            )),
            None => anomalies.push(format!(
                "replica-{} did not exit within 12 s of SIGTERM at {} ms",
                f.replica, f.start_ms
            )),
        }
    }

    // Store errors: explained by a fault under way (on any replica) from
    // one lease before the send until its answer, or not.
    let mut store_errors_in_faults = 0;
    let mut store_errors_unexplained = Vec::new();
    for intent in &intents {
        for s in &intent.sends {
            let Outcome::Answer {
                problem: Some(p), ..
            } = &s.outcome
            else {
                continue;
            };
            if p != "store-unavailable" {
                continue;
            }
            let from = s.start_ms.saturating_sub(lease_ms);
            let explained = faults
                .iter()
                .any(|f| f.start_ms <= s.end_ms && f.end_ms + lease_ms >= from);
            if explained {
                store_errors_in_faults += 1;
            } else {
                store_errors_unexplained.push(format!(
                    "{}: 503 store-unavailable via replica-{} at {}-{} ms",
                    intent.key, s.replica, s.start_ms, s.end_ms
                ));
            }
        }
    }

    let count = |kind: FaultKind| faults.iter().filter(|f| f.kind == kind).count();
    let longest = |kind: FaultKind| {
        faults
            .iter()
            .filter(|f| f.kind == kind)
            .map(|f| f.end_ms - f.start_ms)
            .max()
            .unwrap_or(0)
    };
    let text = format!(
        "{title}: seed {seed}, {clients} clients, {replicas} replicas, lease {lease_ms} ms, \
         client timeout {timeout} ms, faults for {secs} s, total {total:.1} s\n\
         faults: {kills} kills (SIGKILL + restart, longest {kill_max} ms until ready again), \
         {long} pauses past the lease (longest {long_max} ms), {short} short pauses (< lease/8), \
         {slowdowns} upstream slowdowns{terms}\n\
         intents {intents} ({late} finished after the faults), sends {sends} \
         (retries {retries}), no answer {no_answer}, problems {problems:?}\n\
         upstream executions {executions} (total counted {total_exec}), takeovers {takeovers} \
         ({idle} of them of claims never forwarded), keys executed twice {twice} (owner killed: \
         {after_kill}, owner paused past the lease: {after_pause})\n\
         answers: {fresh} executed, {replays} replays ({checked} checked against the store), \
         {fenced} from fenced-out owners; \"took over\" logged {took_over}×, \
         \"lease lost\" logged {lost}×\n\
         second executions by a live owner whose lease ran out (known issue, see \
         RELIABILITY.md): {outrun}\n\
         store errors (503 store-unavailable): {in_faults} during faults, {unexplained} \
         unexplained\n\
         traffic {traffic_ms} ms; anomalies: {n_anomalies}\n",
        terms = if settings.sigterm {
            format!(
                ", {} SIGTERM restarts (drain, exit, start; longest {} ms until ready again)",
                count(FaultKind::Term),
                longest(FaultKind::Term)
            )
        } else {
            String::new()
        },
        in_faults = store_errors_in_faults,
        unexplained = store_errors_unexplained.len(),
        seed = settings.seed,
        clients = settings.clients,
        replicas = settings.replicas,
        timeout = settings.client_timeout.as_millis(),
        secs = settings.duration.as_secs(),
        total = run_started.elapsed().as_secs_f64(),
        kills = count(FaultKind::Kill),
        long = count(FaultKind::LongPause),
        short = count(FaultKind::ShortPause),
        kill_max = longest(FaultKind::Kill),
        long_max = longest(FaultKind::LongPause),
        intents = report.intents,
        late = finished_late,
        sends = report.sends,
        retries = report.sends - report.intents,
        no_answer = report.no_answer,
        problems = report.problems,
        executions = report.executions,
        total_exec = stats["total"],
        takeovers = report.takeovers,
        twice = report.keys_executed_twice,
        idle = report.takeovers_without_execution,
        after_kill = report.twice_after_kill,
        after_pause = report.twice_after_pause,
        fresh = report.fresh_answers,
        replays = report.replays,
        checked = report.replays_checked,
        fenced = report.fenced_answers,
        took_over = logs.matches("took over a claim").count(),
        lost = logs.matches("lease lost").count(),
        outrun = lease_outrun.len(),
        n_anomalies = anomalies.len(),
    );
    let mut full = text.clone();
    for a in anomalies.iter().take(50) {
        let _ = writeln!(full, "  anomaly: {a}");
    }
    for a in lease_outrun.iter().take(20) {
        let _ = writeln!(full, "  lease outrun: {a}");
    }
    for a in store_errors_unexplained.iter().take(20) {
        let _ = writeln!(full, "  unexplained store error: {a}");
    }
    RunResult {
        report: full,
        anomalies,
        faults,
        intents: report.intents,
        store_errors_in_faults,
        store_errors_unexplained,
    }
}

#[derive(Default)]
struct Report {
    intents: u64,
    sends: u64,
    no_answer: u64,
    problems: BTreeMap<String, u64>,
    replays: u64,
    replays_checked: u64,
    fresh_answers: u64,
    fenced_answers: u64,
    executions: u64,
    takeovers: u64,
    takeovers_without_execution: u64,
    twice_after_kill: u64,
    twice_after_pause: u64,
    keys_executed_twice: u64,
}

fn brief(o: &Outcome) -> String {
    match o {
        Outcome::NoAnswer(e) => format!("no answer ({})", e.chars().take(40).collect::<String>()),
        Outcome::Answer {
            status,
            replayed,
            problem,
            ..
        } => format!(
            "{status}{}{}",
            if *replayed { " replay" } else { "" },
            problem
                .as_deref()
                .map(|p| format!(" {p}"))
                .unwrap_or_default()
        ),
    }
}

/// What the replicas logged about a key (and how often their lease
/// renewals failed), to tell a starved owner from a bug.
fn evidence(replica_logs: &[String], key: &str) -> Vec<String> {
    let mentions = |line: &str| {
        [format!("key={key} "), format!("key=\"{key}\"")]
            .iter()
            .any(|k| line.contains(k.as_str()) || line.ends_with(k.trim_end()))
    };
    let mut out = Vec::new();
    for (i, log) in replica_logs.iter().enumerate() {
        for line in log.lines().filter(|l| mentions(l)).take(6) {
            out.push(format!("    replica-{i}: {line}"));
        }
        let failed = log.matches("lease renewal failed").count();
        if failed > 0 {
            out.push(format!(
                "    replica-{i}: {failed} failed lease renewals in the run"
            ));
        }
    }
    out
}
