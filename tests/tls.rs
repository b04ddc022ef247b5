//! TLS (issue "Security"): an `https://` upstream verified against a test
//! CA and refused when its certificate is wrong; TLS on the proxy listener
//! (HTTP/1.1 and h2 by ALPN). PostgreSQL over TLS is in `postgres_tls.rs`.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemproxy::app::{self, ServeOptions};
use idemproxy::config::{self, Overrides};
use rustls::pki_types::ServerName;
use sample_upstream::SampleUpstreamHandle;
use support::db::TestDb;
use support::harness::{start_upstream, Setup};
use support::http::{HttpClient, Req};
use support::tls_fixtures::{quoted, start_edited, with_key, Ca, Leaf, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

const PAY: &str = r#"{"amount": 100}"#;

fn acceptor(leaf: &Leaf, alpn: &[&[u8]]) -> TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(leaf.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(idemproxy::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    TlsAcceptor::from(Arc::new(config))
}

fn connector(ca: &Ca, alpn: &[&[u8]]) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.issuer.der().clone()).unwrap();
    let mut config = idemproxy::tls::client_config(roots).unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    TlsConnector::from(Arc::new(config))
}

// ---------------------------------------------------------------------------
// (a) An https:// upstream.

/// Terminates TLS on a port-0 socket and relays the plaintext to `backend`
/// (the sample upstream), so the upstream's counters still count.
async fn tls_front(leaf: &Leaf, backend: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = acceptor(leaf, &[]);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A failed handshake (the proxy refused our certificate) just
                // ends this connection.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut plain) = TcpStream::connect(backend).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}
/// The sample upstream and a fresh database, for proxies to stand in
/// front of.
struct Backend {
    db: TestDb,
    upstream: SampleUpstreamHandle,
    _stop_upstream: tokio::sync::oneshot::Sender<()>,
}

impl Backend {
    async fn start() -> Backend {
        let db = TestDb::new().await;
        let (upstream, stop) = start_upstream().await;
        Backend {
            db,
            upstream,
            _stop_upstream: stop,
        }
    }

    async fn record_count(&self) -> i64 {
        self.db
            .client()
            .await
            .query_one("SELECT count(*) FROM idempotency_records", &[])
            .await
            .unwrap()
            .get(0)
    }
}

#[tokio::test]
async fn https_upstream_verified_against_the_configured_ca_executes_once_and_replays() {
    let ca = Ca::new("idemproxy test CA");
    let dir = TempDir::new("tls-upstream");
    let ca_file = dir.write("ca.pem", &ca.pem());
    let leaf = ca.leaf(&["localhost", "127.0.0.1"]);
    let s = Backend::start().await;
    let front = tls_front(&leaf, s.upstream.addr()).await;
    let with_ca = |t| with_key(t, "upstream", &format!("ca_file = {}", quoted(&ca_file)));
    let proxy = start_edited(
        &Setup::default(),
        &format!("https://127.0.0.1:{}", front.port()),
        &s.db.url,
        with_ca,
    )
    .await;
    let client = HttpClient::new();
    let url = format!("http://{}/v1/orders", proxy.proxy_addr);
    let first = client.send(Req::post(&url).key("k-https").json(PAY)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = client.send(Req::post(&url).key("k-https").json(PAY)).await;
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(again.body, first.body);
    assert_eq!(s.upstream.executions("k-https"), 1);
    // The Host the upstream saw is its own address, and the key went along.
    let seen = &s.upstream.requests()[0];
    assert_eq!(seen.key, "k-https");
    // A host name in the certificate works as well as an IP address.
    let by_name = start_edited(
        &Setup::default(),
        &format!("https://localhost:{}", front.port()),
        &s.db.url,
        with_ca,
    )
    .await;
    let r = client
        .send(
            Req::post(&format!("http://{}/v1/orders", by_name.proxy_addr))
                .key("k-https-name")
                .json(PAY),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    proxy.shutdown().await;
    by_name.shutdown().await;
}

/// A proxy whose https upstream presents `leaf`; returns the problem a keyed
/// request gets, after checking nothing was stored or executed.
async fn refused_upstream(leaf: &Leaf, host: &str, ca_file: Option<&Path>) -> serde_json::Value {
    let s = Backend::start().await;
    let addr = tls_front(leaf, s.upstream.addr()).await;
    let proxy = start_edited(
        &Setup::default(),
        &format!("https://{host}:{}", addr.port()),
        &s.db.url,
        |t| match ca_file {
            Some(ca) => with_key(t, "upstream", &format!("ca_file = {}", quoted(ca))),
            None => t,
        },
    )
    .await;
    let url = format!("http://{}/v1/orders", proxy.proxy_addr);
    let r = HttpClient::new()
        .send(Req::post(&url).key("k-bad-cert").json(PAY))
        .await;
    r.assert_problem(502, "upstream-unreachable");
    assert_eq!(
        s.upstream.total_requests(),
        0,
        "nothing may reach an unverified upstream"
    );
    assert_eq!(s.record_count().await, 0, "the claim is released");
    proxy.shutdown().await;
    r.json()
}

#[tokio::test]
async fn https_upstream_signed_by_another_ca_is_refused_with_502_and_nothing_sent() {
    let ca = Ca::new("idemproxy test CA");
    let other = Ca::new("some other CA");
    let dir = TempDir::new("tls-wrong-ca");
    let other_file = dir.write("other.pem", &other.pem());
    let leaf = ca.leaf(&["localhost", "127.0.0.1"]);
    let problem = refused_upstream(&leaf, "127.0.0.1", Some(&other_file)).await;
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("certificate"), "{detail}");
    // Without any CA file only the system store is trusted: refused too.
    let problem = refused_upstream(&leaf, "127.0.0.1", None).await;
    assert!(
        problem["detail"].as_str().unwrap().contains("certificate"),
        "{problem}"
    );
}

#[tokio::test]
async fn https_upstream_whose_certificate_names_another_host_is_refused() {
    let ca = Ca::new("idemproxy test CA");
    let dir = TempDir::new("tls-wrong-name");
    let ca_file = dir.write("ca.pem", &ca.pem());
    // Issued by the trusted CA, but for another name.
    let leaf = ca.leaf(&["upstream.example"]);
    let problem = refused_upstream(&leaf, "127.0.0.1", Some(&ca_file)).await;
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("certificate"), "{detail}");
}

#[test]
fn upstream_ca_file_is_refused_with_an_http_upstream_and_must_exist_at_start() {
    let err = config::parse(
        "[upstream]\nurl = \"http://127.0.0.1:3000\"\nca_file = \"/x/ca.pem\"\n",
        "t.toml",
        &Overrides::default(),
    )
    .unwrap_err();
    assert_eq!(err.problems[0].key, "upstream.ca_file");
    let config = config::parse(
        "[upstream]\nurl = \"https://127.0.0.1:3000\"\nca_file = \"/nonexistent/ca.pem\"\n",
        "t.toml",
        &Overrides::default(),
    )
    .unwrap();
    let err = idemproxy::proxy::upstream::Upstream::new(&config.upstream)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("upstream.ca_file") && err.contains("/nonexistent/ca.pem"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------
// (b) TLS on the proxy listener.

/// One request over TLS with the given ALPN offer; the version spoken and
/// the response.
async fn request_over_tls(
    addr: SocketAddr,
    ca: &Ca,
    alpn: &[&[u8]],
    req: Request<Full<Bytes>>,
) -> (Version, StatusCode, http::HeaderMap, Bytes) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = connector(ca, alpn)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let io = TokioIo::new(tls);
    let resp = if h2 {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    };
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.version, parts.status, parts.headers, body)
}

fn keyed_request(key: &str, h2: bool) -> Request<Full<Bytes>> {
    let mut b = Request::post("https://localhost/v1/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if h2 {
        b = b.version(Version::HTTP_2);
    } else {
        b = b.header("host", "localhost");
    }
    b.body(Full::new(Bytes::from_static(PAY.as_bytes())))
        .unwrap()
}

#[tokio::test]
async fn tls_listener_serves_http1_and_h2_by_alpn_and_forwards_proto_https() {
    let ca = Ca::new("idemproxy test CA");
    let dir = TempDir::new("tls-listener");
    let leaf = ca.leaf(&["localhost", "127.0.0.1"]);
    let cert = dir.write("server.pem", &leaf.cert_pem);
    let key = dir.write("server.key", &leaf.key_pem);
    let s = Backend::start().await;
    let proxy = start_edited(
        &Setup::default().server("header_read_timeout = \"1s\"\n"),
        &s.upstream.url(),
        &s.db.url,
        |t| {
            with_key(
                t,
                "server",
                &format!(
                    "tls_cert_file = {}\ntls_key_file = {}",
                    quoted(&cert),
                    quoted(&key)
                ),
            )
        },
    )
    .await;
    let addr = proxy.proxy_addr;

    let (v, status, _, body) =
        request_over_tls(addr, &ca, &[b"http/1.1"], keyed_request("k-tls", false)).await;
    assert_eq!((v, status.as_u16()), (Version::HTTP_11, 201), "{body:?}");
    let (v, status, headers, replay) = request_over_tls(
        addr,
        &ca,
        &[b"h2", b"http/1.1"],
        keyed_request("k-tls", true),
    )
    .await;
    assert_eq!((v, status.as_u16()), (Version::HTTP_2, 201));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay, body);
    // No ALPN at all: HTTP/1.1.
    let (v, status, _, _) = request_over_tls(addr, &ca, &[], keyed_request("k-tls-2", false)).await;
    assert_eq!((v, status.as_u16()), (Version::HTTP_11, 201));

    assert_eq!(s.upstream.executions("k-tls"), 1);
    for seen in s.upstream.requests() {
        let proto = String::from_utf8_lossy(seen.header("x-forwarded-proto").unwrap()).into_owned();
        assert_eq!(proto, "https", "{seen:?}");
    }

    // Plain HTTP on the TLS port: refused at the handshake, promptly.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-plain\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "plain HTTP on the TLS port hung");
    assert!(!String::from_utf8_lossy(&buf).contains("201"));

    // A client that connects and never starts the handshake is cut off
    // after header_read_timeout.
    let started = Instant::now();
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut [0u8; 16])).await;
    assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
    assert!(started.elapsed() < Duration::from_secs(3));

    // k-tls once (its h2 retry was a replay), k-tls-2 once.
    assert_eq!(s.upstream.total_requests(), 2);
    proxy.shutdown().await;
}

#[tokio::test]
async fn tls_listener_files_are_checked_at_start() {
    let ca = Ca::new("idemproxy test CA");
    let dir = TempDir::new("tls-listener-bad");
    let leaf = ca.leaf(&["localhost"]);
    let other = ca.leaf(&["localhost"]);
    let cert = dir.write("server.pem", &leaf.cert_pem);
    let wrong_key = dir.write("other.key", &other.key_pem);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ntls_cert_file = {}\ntls_key_file = {}\n",
        quoted(&cert),
        quoted(&wrong_key)
    );
    let config = config::parse(&text, "t.toml", &Overrides::default()).unwrap();
    let err = app::start(config, ServeOptions::default())
        .await
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("server.tls_key_file"),
        "{err:#}"
    );
    // One without the other is a configuration problem.
    let err = config::parse(
        &format!("[server]\ntls_cert_file = {}\n", quoted(&cert)),
        "t.toml",
        &Overrides::default(),
    )
    .unwrap_err();
    assert_eq!(err.problems[0].key, "server.tls_cert_file");
}
