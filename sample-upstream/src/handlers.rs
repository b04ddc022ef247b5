//! The request path: control headers → count and record → answer; and the
//! `/__sample/` control endpoints, which are never counted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, SET_COOKIE};
use hyper::{Method, Request, Response, StatusCode};
use sha2::{Digest, Sha256};

use crate::slow_body::SlowBody;
use crate::{
    body_pattern, RecordedRequest, SampleBody, SampleUpstream, ServiceError, BODY_SIZE_HEADER,
    CONTROL_PREFIX, DELAY_HEADER, ECHO_ATTEMPT_HEADER, EXECUTION_HEADER, FAIL_HEADER,
    IDEMPOTENCY_ATTEMPT_HEADER, IDEMPOTENCY_KEY_HEADER, MAX_BODY_SIZE, MAX_SET_COOKIES,
    SET_COOKIE_HEADER, SLOW_BODY_HEADER, STATUS_HEADER,
};

/// What the control headers of a request ask for.
#[derive(Debug, Default)]
struct Controls {
    delay: Option<Duration>,
    status: Option<StatusCode>,
    fail: Option<Fail>,
    body_size: Option<usize>,
    set_cookies: usize,
    slow_body: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fail {
    Reset,
    Hang,
}

impl Controls {
    fn parse(headers: &HeaderMap) -> Result<Self, String> {
        let status = parse_number::<u16>(headers, STATUS_HEADER)?
            .map(|code| {
                StatusCode::from_u16(code)
                    .ok()
                    .filter(|s| !s.is_informational())
                    .ok_or_else(|| format!("{STATUS_HEADER}: {code} is not a final status code"))
            })
            .transpose()?;
        let fail = match header_str(headers, FAIL_HEADER)? {
            None => None,
            Some(v) if v.eq_ignore_ascii_case("reset") => Some(Fail::Reset),
            Some(v) if v.eq_ignore_ascii_case("hang") => Some(Fail::Hang),
            Some(v) => {
                return Err(format!(
                    "{FAIL_HEADER}: expected `reset` or `hang`, got {v:?}"
                ))
            }
        };
        let body_size = parse_number::<usize>(headers, BODY_SIZE_HEADER)?;
        if body_size.is_some_and(|n| n > MAX_BODY_SIZE) {
            return Err(format!("{BODY_SIZE_HEADER}: at most {MAX_BODY_SIZE}"));
        }
        let set_cookies = parse_number::<usize>(headers, SET_COOKIE_HEADER)?.unwrap_or(0);
        if set_cookies > MAX_SET_COOKIES {
            return Err(format!("{SET_COOKIE_HEADER}: at most {MAX_SET_COOKIES}"));
        }
        Ok(Controls {
            delay: parse_number::<u64>(headers, DELAY_HEADER)?.map(Duration::from_millis),
            status,
            fail,
            body_size,
            set_cookies,
            slow_body: parse_number::<u64>(headers, SLOW_BODY_HEADER)?.map(Duration::from_millis),
        })
    }
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, String> {
    headers
        .get(name)
        .map(|v| {
            v.to_str()
                .map(str::trim)
                .map_err(|_| format!("{name}: not visible ASCII"))
        })
        .transpose()
}

fn parse_number<T: std::str::FromStr>(
    headers: &HeaderMap,
    name: &str,
) -> Result<Option<T>, String> {
    header_str(headers, name)?
        .map(|v| {
            v.parse::<T>()
                .map_err(|_| format!("{name}: {v:?} is not a valid non-negative integer"))
        })
        .transpose()
}

fn lossy_header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

pub(crate) async fn handle(
    state: Arc<SampleUpstream>,
    req: Request<Incoming>,
) -> Result<Response<SampleBody>, ServiceError> {
    if req.uri().path().starts_with(CONTROL_PREFIX) {
        return Ok(control(&state, &req));
    }
    let controls = match Controls::parse(req.headers()) {
        Ok(controls) => controls,
        Err(error) => {
            tracing::warn!(%error, "sample upstream: malformed control header; not executed");
            let body = serde_json::json!({ "error": error });
            return Ok(json_response(StatusCode::BAD_REQUEST, &body));
        }
    };

    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let key = lossy_header(&parts.headers, IDEMPOTENCY_KEY_HEADER).unwrap_or_default();
    let attempt =
        lossy_header(&parts.headers, IDEMPOTENCY_ATTEMPT_HEADER).unwrap_or_else(|| "none".into());
    let method = parts.method.to_string();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let headers = parts
        .headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    let (execution, key_executions) = state.record(RecordedRequest {
        method: method.clone(),
        path: path.clone(),
        key: key.clone(),
        headers,
        body: body.clone(),
        execution: 0,
        key_execution: 0,
    });
    tracing::info!(%method, %path, %key, execution, key_executions, "sample upstream executed a request");

    if let Some(delay) = controls.delay.or(state.options.delay) {
        tokio::time::sleep(delay).await;
    }
    match controls.fail {
        Some(Fail::Reset) => return Err(ServiceError::Reset),
        Some(Fail::Hang) => {
            let mut stopping = state.stopping.subscribe();
            let _ = stopping.wait_for(|s| *s).await;
            return Err(ServiceError::ShuttingDown);
        }
        None => {}
    }

    let (content_type, payload) = match controls.body_size {
        Some(n) => ("application/octet-stream", Bytes::from(body_pattern(n))),
        None => {
            let mut json = serde_json::json!({
                "execution": execution,
                "key_executions": key_executions,
                "key": key,
                "attempt": attempt,
                "method": method,
                "path": path,
                "body_sha256": hex::encode(Sha256::digest(&body)),
                "body_len": body.len(),
            });
            if state.options.charges {
                json["id"] = format!("ch_{execution}").into();
                json["object"] = "charge".into();
            }
            ("application/json", Bytes::from(json.to_string()))
        }
    };
    let body = match controls.slow_body {
        Some(interval) => SlowBody::new(payload, interval).boxed(),
        None => Full::new(payload).boxed(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = controls.status.unwrap_or(StatusCode::CREATED);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        HeaderName::from_static(EXECUTION_HEADER),
        HeaderValue::from(execution),
    );
    headers.insert(
        HeaderName::from_static(ECHO_ATTEMPT_HEADER),
        HeaderValue::from_bytes(attempt.as_bytes())
            .unwrap_or_else(|_| HeaderValue::from_static("invalid")),
    );
    for i in 1..=controls.set_cookies {
        if let Ok(cookie) = HeaderValue::try_from(format!("c{i}=v{i}")) {
            headers.append(SET_COOKIE, cookie);
        }
    }
    Ok(response)
}

/// Answers the `/__sample/` control endpoints; never counted.
fn control(state: &SampleUpstream, req: &Request<Incoming>) -> Response<SampleBody> {
    let endpoint = req.uri().path().trim_start_matches(CONTROL_PREFIX);
    if !matches!(endpoint, "health" | "executions" | "stats") {
        let body = serde_json::json!({ "error": "unknown control endpoint" });
        return json_response(StatusCode::NOT_FOUND, &body);
    }
    if req.method() != Method::GET {
        let body = serde_json::json!({ "error": "control endpoints only answer GET" });
        let mut response = json_response(StatusCode::METHOD_NOT_ALLOWED, &body);
        response
            .headers_mut()
            .insert(hyper::header::ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    match endpoint {
        "health" => {
            let mut response = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            response
        }
        "executions" => {
            let key = req.uri().query().and_then(|q| query_param(q, "key"));
            match key {
                Some(key) => {
                    let executions = state.counters().per_key.get(&key).copied().unwrap_or(0);
                    let body = serde_json::json!({ "key": key, "executions": executions });
                    json_response(StatusCode::OK, &body)
                }
                None => {
                    let body = serde_json::json!({ "error": "missing query parameter `key`" });
                    json_response(StatusCode::BAD_REQUEST, &body)
                }
            }
        }
        _ => {
            let counters = state.counters();
            let keys: BTreeMap<&str, u64> = counters
                .per_key
                .iter()
                .map(|(k, n)| (k.as_str(), *n))
                .collect();
            let body = serde_json::json!({ "total": counters.total, "keys": keys });
            json_response(StatusCode::OK, &body)
        }
    }
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<SampleBody> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The form-url-decoded value of the first `name` parameter of `query`.
pub(crate) fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
        (form_decode(n) == name).then(|| form_decode(v))
    })
}

/// Decodes `application/x-www-form-urlencoded` text (`+` is a space, `%XX`
/// an escaped byte; malformed escapes are kept as-is), lossily as UTF-8.
pub(crate) fn form_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).and_then(|h| {
                    std::str::from_utf8(h)
                        .ok()
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                });
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
