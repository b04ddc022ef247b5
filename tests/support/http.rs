//! A small HTTP client for the tests ([`HttpClient`]): a request to build
//! ([`Req`]), a response read whole ([`Resp`]), and the Prometheus text
//! reader of `/metrics`.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A request to send.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: Method,
    pub path: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

impl Req {
    pub fn new(method: Method, url: &str) -> Req {
        Req {
            method,
            path: url.into(),
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }
    pub fn post(url: &str) -> Req {
        Req::new(Method::POST, url)
    }
    pub fn get(url: &str) -> Req {
        Req::new(Method::GET, url)
    }
    pub(super) fn at(mut self, url: &str) -> Req {
        self.path = url.into();
        self
    }
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Req {
        self.headers.push((name.into(), value.as_ref().to_vec()));
        self
    }
    pub fn key(self, key: &str) -> Req {
        self.header("Idempotency-Key", key)
    }
    pub fn json(mut self, body: &str) -> Req {
        self.body = Bytes::copy_from_slice(body.as_bytes());
        self.header("Content-Type", "application/json")
    }
    pub fn body(mut self, body: impl Into<Bytes>) -> Req {
        self.body = body.into();
        self
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
    /// The upstream's execution number (sample upstream header).
    pub fn execution(&self) -> Option<u64> {
        self.header("x-sample-execution")
            .and_then(|v| v.parse().ok())
    }
    /// Asserts a proxy problem of the given type slug and status.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status.as_u16(), status, "{}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{}",
            self.text()
        );
        let v = self.json();
        assert_eq!(
            v["type"],
            format!("urn:idemproxy:problem:{slug}"),
            "{}",
            self.text()
        );
        assert_eq!(v["status"], status);
        assert!(v["title"].is_string() && v["detail"].is_string());
    }
}

/// An HTTP/1.1 client (or h2c with `http2_only`).
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        HttpClient {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    pub fn h2c() -> Self {
        HttpClient {
            client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(HttpConnector::new()),
        }
    }

    pub async fn send(&self, req: Req) -> Resp {
        self.try_send(req).await.expect("request failed")
    }

    pub async fn try_send(&self, req: Req) -> Result<Resp, String> {
        let mut b = Request::builder().method(req.method).uri(&req.path);
        for (n, v) in &req.headers {
            b = b.header(n.as_str(), v.as_slice());
        }
        let request = b.body(Full::new(req.body)).map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Resp {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

/// Reads one series (`name{labels}`) from Prometheus text. When no line
/// is exactly that series, the sum of the series whose labels include the
/// given ones (`idemproxy_requests_total{route="r",outcome="o"}` adds up
/// its status classes).
pub fn metric_value(text: &str, series: &str) -> f64 {
    let samples = || {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
    };
    if let Some(v) =
        samples().find_map(|(name, value)| (name == series).then(|| value.parse().ok())?)
    {
        return v;
    }
    let (name, labels) = match series.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (series, ""),
    };
    let wanted: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
    if wanted.is_empty() {
        return 0.0;
    }
    samples()
        .filter_map(|(s, value)| {
            let (n, l) = s.split_once('{')?;
            let have: Vec<&str> = l.trim_end_matches('}').split(',').collect();
            (n == name && wanted.iter().all(|w| have.contains(w)))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
