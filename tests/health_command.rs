//! `idemproxy health`: the healthcheck of shell-less images (docs/deploy.md).
//! Exit 0 when the URL answers 2xx within the timeout, 1 otherwise.

use std::process::Output;
use std::time::{Duration, Instant};

use sample_upstream::{SampleUpstream, SampleUpstreamHandle};
use tokio::net::TcpListener;
use tokio::process::Command;

async fn health(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("health")
        .args(args)
        .env_remove("IDEMPROXY_CONFIG")
        .env_remove("IDEMPROXY_DATABASE_URL")
        .output()
        .await
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

async fn upstream() -> (SampleUpstreamHandle, tokio::sync::oneshot::Sender<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let up = SampleUpstream::start("127.0.0.1:0".parse().unwrap(), async move {
        let _ = rx.await;
    })
    .await
    .unwrap();
    (up, tx)
}

#[tokio::test]
async fn health_exits_0_on_a_2xx_answer() {
    let (up, _stop) = upstream().await;
    let out = health(&["--url", &format!("{}/__sample/health", up.url())]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("200"), "{}", stdout(&out));
}

#[tokio::test]
async fn health_exits_1_on_a_non_2xx_answer() {
    let (up, _stop) = upstream().await;
    let out = health(&["--url", &format!("{}/__sample/nope", up.url())]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("404"), "{}", stderr(&out));
}

#[tokio::test]
async fn health_exits_1_when_nothing_listens_and_says_why() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let out = health(&["--url", &format!("http://127.0.0.1:{port}/readyz")]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("refused"),
        "the cause chain is shown: {}",
        stderr(&out)
    );
}

#[tokio::test]
async fn health_exits_1_when_the_answer_does_not_come_within_the_timeout() {
    // Accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let started = Instant::now();
    let out = health(&[
        "--url",
        &format!("http://{addr}/readyz"),
        "--timeout",
        "300ms",
    ])
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("did not answer within"),
        "{}",
        stderr(&out)
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    hold.abort();
}

#[tokio::test]
async fn health_refuses_urls_it_cannot_probe() {
    for url in ["ftp://127.0.0.1/", "/readyz"] {
        let out = health(&["--url", url]).await;
        assert_eq!(out.status.code(), Some(1), "{url}");
        assert!(
            stderr(&out).contains("only absolute http://"),
            "{url}: {}",
            stderr(&out)
        );
    }
}

#[tokio::test]
async fn health_without_url_probes_readyz_on_the_configured_admin_listener() {
    // The sample upstream answers any path with 201; it stands in for the
    // admin listener, which the config binds to every address.
    let (up, _stop) = upstream().await;
    let dir = std::env::temp_dir().join(format!("idemproxy-health-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemproxy.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"0.0.0.0:{}\"\n",
            up.addr().port()
        ),
    )
    .unwrap();
    let out = health(&["--config", config.to_str().unwrap()]).await;
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let expected = format!("http://127.0.0.1:{}/readyz", up.addr().port());
    assert!(stdout(&out).contains(&expected), "{}", stdout(&out));
}
