//! Header rules for forwarding and storing (DESIGN.md §6).

use std::net::IpAddr;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONNECTION, DATE};
use http::HeaderMap;

/// Headers that belong to one connection, never forwarded nor stored.
const HOP_BY_HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
];

/// Whether `name` is hop-by-hop on its own (not counting names listed in
/// `Connection`).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n) || n.starts_with("proxy-")
}

/// Names listed in the `Connection` header(s).
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect()
}

/// Removes every hop-by-hop header, including those named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_listed(headers) {
        headers.remove(name);
    }
    let fixed: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    for name in fixed {
        headers.remove(name);
    }
}

/// The end-to-end headers of a response, as stored: hop-by-hop headers
/// and `Date` (a replay gets a fresh one) left out, repeated headers kept
/// as separate entries in order.
pub fn capture(headers: &HeaderMap) -> Vec<(String, Bytes)> {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(|(n, _)| !is_hop_by_hop(n) && !listed.contains(n) && *n != DATE)
        .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
        .collect()
}

/// Appends `value` to a possibly repeated, comma-separated header.
fn append_list(headers: &mut HeaderMap, name: &'static str, value: &str) {
    let existing: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let joined = if existing.is_empty() {
        value.to_owned()
    } else {
        format!("{}, {}", existing.join(", "), value)
    };
    if let Ok(v) = HeaderValue::from_str(&joined) {
        headers.insert(HeaderName::from_static(name), v);
    }
}

/// Adds `X-Forwarded-For`, `-Proto` and `-Host`, appending to what the
/// client sent.
pub fn add_forwarded(headers: &mut HeaderMap, client: IpAddr, proto: &str, host: Option<&str>) {
    append_list(headers, "x-forwarded-for", &client.to_string());
    append_list(headers, "x-forwarded-proto", proto);
    if let Some(host) = host {
        append_list(headers, "x-forwarded-host", host);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn hop_by_hop_and_connection_listed_headers_are_removed() {
        let mut h = map(&[
            ("connection", "keep-alive, X-Secret-Hop"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic x"),
            ("proxy-connection", "keep-alive"),
            ("x-secret-hop", "1"),
            ("content-type", "application/json"),
            ("idempotency-key", "k"),
        ]);
        strip_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["content-type", "idempotency-key"]);
    }

    #[test]
    fn capture_keeps_repeated_headers_as_separate_entries_and_drops_date() {
        let h = map(&[
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("date", "Tue, 01 Dec 2026 00:00:00 GMT"),
            ("transfer-encoding", "chunked"),
            ("x-request-id", "r1"),
        ]);
        let c = capture(&h);
        assert_eq!(
            c,
            vec![
                ("set-cookie".to_owned(), Bytes::from_static(b"a=1")),
                ("set-cookie".to_owned(), Bytes::from_static(b"b=2")),
                ("x-request-id".to_owned(), Bytes::from_static(b"r1")),
            ]
        );
    }

    #[test]
    fn forwarded_headers_append_to_what_the_client_sent() {
        let mut h = map(&[
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-for", "10.0.0.2"),
        ]);
        add_forwarded(
            &mut h,
            "127.0.0.1".parse().unwrap(),
            "http",
            Some("api.example"),
        );
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 127.0.0.1");
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example");
    }
}
