//! The chaos clients: each sends fresh keys through random replicas and
//! retries until it gets a definitive answer, sometimes twice at once (a
//! "double click"), sometimes again after the answer (which must replay).

use std::sync::Arc;
use std::time::Duration;

use super::{Clock, Intent, Outcome, SendRecord, Settings};
use crate::support::http::{HttpClient, Req};
use crate::support::rng::Rng;

async fn send_once(
    http: &HttpClient,
    urls: &[String],
    replica: usize,
    intent: &Intent,
    timeout: Duration,
    clock: &Clock,
) -> SendRecord {
    let start_ms = clock.ms();
    let req = Req::post(&format!("{}/v1/orders", urls[replica]))
        .key(&intent.key)
        .json(&intent.body)
        .header("x-sample-delay-ms", intent.delay_ms.to_string());
    let outcome = match tokio::time::timeout(timeout, http.try_send(req)).await {
        Err(_) => Outcome::NoAnswer("client timeout".into()),
        Ok(Err(e)) => Outcome::NoAnswer(e),
        Ok(Ok(r)) => {
            let problem = (r.header("content-type") == Some("application/problem+json"))
                .then(|| {
                    r.json()["type"]
                        .as_str()
                        .map(|t| t.trim_start_matches("urn:idemproxy:problem:").to_owned())
                })
                .flatten();
            Outcome::Answer {
                status: r.status.as_u16(),
                replayed: r.replayed(),
                problem,
                body: r.body,
            }
        }
    };
    SendRecord {
        replica,
        start_ms,
        end_ms: clock.ms(),
        outcome,
    }
}

/// Sends an intent until it gets a definitive answer (or gives up).
pub(super) async fn resolve(
    http: &HttpClient,
    urls: &[String],
    intent: &mut Intent,
    rng: &mut Rng,
    settings: &Settings,
    clock: &Clock,
    max_sends: usize,
) {
    // Now and then a "double click": the first send goes to two replicas at once.
    if rng.chance(0.1) {
        let a = rng.pick(urls.len());
        let b = (a + 1 + rng.pick(urls.len() - 1)) % urls.len();
        let (ra, rb) = tokio::join!(
            send_once(http, urls, a, intent, settings.client_timeout, clock),
            send_once(http, urls, b, intent, settings.client_timeout, clock),
        );
        let done = ra.outcome.definitive() || rb.outcome.definitive();
        intent.sends.push(ra);
        intent.sends.push(rb);
        if done {
            intent.resolved_ms = Some(clock.ms());
            return;
        }
    }
    while intent.sends.len() < max_sends {
        let replica = rng.pick(urls.len());
        let s = send_once(http, urls, replica, intent, settings.client_timeout, clock).await;
        let pause = match &s.outcome {
            Outcome::Answer {
                problem: Some(p), ..
            } if p == "request-in-progress" => rng.range(100, 300),
            _ => rng.range(50, 200),
        };
        let done = s.outcome.definitive();
        intent.sends.push(s);
        if done {
            intent.resolved_ms = Some(clock.ms());
            return;
        }
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

pub(super) async fn client(
    id: usize,
    urls: Arc<Vec<String>>,
    settings: Settings,
    clock: Arc<Clock>,
    deadline_ms: u64,
) -> Vec<Intent> {
    let mut rng = Rng::new(settings.seed ^ (id as u64 + 1).wrapping_mul(0xC1A0_5EED));
    let http = HttpClient::new();
    let mut intents = Vec::new();
    let mut n = 0;
    while clock.ms() < deadline_ms {
        n += 1;
        let mut intent = Intent {
            key: format!("c{id}-{n}"),
            body: format!(
                r#"{{"client": {id}, "n": {n}, "amount": {}}}"#,
                rng.range(1, 10_000)
            ),
            delay_ms: rng.range(0, 400),
            sends: Vec::new(),
            resolved_ms: None,
        };
        resolve(&http, &urls, &mut intent, &mut rng, &settings, &clock, 60).await;
        // Duplicate deliveries after the answer: these must all be replays.
        if intent.resolved_ms.is_some() && rng.chance(0.25) {
            for _ in 0..rng.range(1, 3) {
                let replica = rng.pick(urls.len());
                let s = send_once(
                    &http,
                    &urls,
                    replica,
                    &intent,
                    settings.client_timeout,
                    &clock,
                )
                .await;
                intent.sends.push(s);
            }
        }
        intents.push(intent);
    }
    intents
}
