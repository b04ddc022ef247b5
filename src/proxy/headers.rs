//! Header rules for forwarding and storing (DESIGN.md §6).

use std::net::IpAddr;

use bytes::Bytes;
use http::header::{
    Entry, HeaderName, HeaderValue, CONNECTION, DATE, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
};
use http::HeaderMap;

/// Headers that belong to one connection, never forwarded nor stored
/// (`connection` first: `strip_hop_by_hop` counts on it).
const HOP_BY_HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
];

/// [`HOP_BY_HOP`] as names, to remove without parsing them again.
const HOP_BY_HOP_NAMES: [HeaderName; 6] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    TRANSFER_ENCODING,
    TE,
    TRAILER,
    UPGRADE,
];

/// Where `n` (a lower-case name) is in [`HOP_BY_HOP`].
fn hop_by_hop_position(n: &str) -> Option<usize> {
    // By length first: this runs for every header of every message.
    match n.len() {
        2 | 7 | 10 | 17 => HOP_BY_HOP.iter().position(|h| *h == n),
        _ => None,
    }
}

/// Whether `name` is hop-by-hop on its own (not counting names listed in
/// `Connection`).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    let n = name.as_str();
    hop_by_hop_position(n).is_some() || n.starts_with("proxy-")
}

/// Whether a token of `Connection` (any case) names a header that is
/// hop-by-hop on its own: it goes anyway, so it is not parsed into a name.
fn hop_by_hop_token(t: &[u8]) -> bool {
    HOP_BY_HOP
        .iter()
        .any(|h| h.as_bytes().eq_ignore_ascii_case(t))
        || t.get(..6)
            .is_some_and(|p| p.eq_ignore_ascii_case(b"proxy-"))
}

/// Names listed in the `Connection` header(s), other than those
/// hop-by-hop on their own.
fn connection_listed(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty() && !hop_by_hop_token(t))
        .filter_map(|t| HeaderName::from_bytes(t).ok())
}

/// Removes every hop-by-hop header, including those named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names: which of the fixed ones are here (bit i:
    // `HOP_BY_HOP[i]`), and whether any `Proxy-*` is. Most requests have
    // none, most responses only `Connection: keep-alive`, whose tokens are
    // all hop-by-hop by name: neither allocates.
    let mut present = 0u8;
    let mut proxy = false;
    for name in headers.keys() {
        let n = name.as_str();
        match hop_by_hop_position(n) {
            Some(i) => present |= 1 << i,
            None => proxy |= n.starts_with("proxy-"),
        }
    }
    if present == 0 && !proxy {
        return;
    }
    if present & 1 != 0 {
        // `Connection` is HOP_BY_HOP[0]: the names it lists go too.
        let extra: Vec<HeaderName> = connection_listed(headers).collect();
        for name in extra {
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP_NAMES.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    if proxy {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| n.as_str().starts_with("proxy-"))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
}

/// The end-to-end headers of a response, as stored: hop-by-hop headers
/// and `Date` (a replay gets a fresh one) left out, repeated headers kept
/// as separate entries in order.
pub fn capture(headers: &HeaderMap) -> Vec<(String, Bytes)> {
    let listed: Vec<HeaderName> = connection_listed(headers).collect();
    headers
        .iter()
        .filter(|(n, _)| !is_hop_by_hop(n) && !listed.contains(n) && *n != DATE)
        .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
        .collect()
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Appends `value` to a possibly repeated, comma-separated header; the
/// value itself when the header is absent (the common case: no copy).
fn append_list(headers: &mut HeaderMap, name: HeaderName, value: HeaderValue) {
    // One lookup for the common case (entry, not contains_key + insert).
    let mut present = match headers.entry(name) {
        Entry::Vacant(e) => {
            e.insert(value);
            return;
        }
        Entry::Occupied(e) => e,
    };
    let mut joined = Vec::new();
    for v in present.iter().chain([&value]) {
        // A value with obs-text is kept out, as before: the list stays
        // a list of visible strings.
        if v.to_str().is_err() {
            continue;
        }
        if !joined.is_empty() {
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        // Replaces every value the client sent with the one joined list.
        present.insert(v);
    }
}

/// The `X-Forwarded-For` entry of a client address (made once per
/// connection).
pub fn forwarded_for(client: IpAddr) -> HeaderValue {
    HeaderValue::from_str(&client.to_string())
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// Adds `X-Forwarded-For`, `-Proto` and `-Host`, appending to what the
/// client sent.
pub fn add_forwarded(
    headers: &mut HeaderMap,
    client: &HeaderValue,
    proto: &'static str,
    host: Option<HeaderValue>,
) {
    append_list(headers, X_FORWARDED_FOR, client.clone());
    append_list(headers, X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    if let Some(host) = host {
        append_list(headers, X_FORWARDED_HOST, host);
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

    /// The names left of `pairs` after stripping, in order.
    fn stripped(pairs: &[(&str, &str)]) -> Vec<String> {
        left(map(pairs))
    }

    /// The names left of `h` after stripping, in order.
    fn left(mut h: HeaderMap) -> Vec<String> {
        strip_hop_by_hop(&mut h);
        h.keys().map(|k| k.as_str().to_owned()).collect()
    }

    #[test]
    fn hop_by_hop_and_connection_listed_headers_are_removed() {
        assert_eq!(
            stripped(&[
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
            ]),
            ["content-type", "idempotency-key"]
        );
    }

    #[test]
    fn a_keep_alive_answer_loses_only_its_connection_headers() {
        // The common upstream answer: `Connection` lists only names that
        // are hop-by-hop themselves, in any case.
        assert_eq!(
            stripped(&[
                ("server", "nginx"),
                ("connection", "Keep-Alive"),
                ("keep-alive", "timeout=5"),
                ("content-length", "2"),
            ]),
            ["server", "content-length"]
        );

        assert_eq!(
            stripped(&[("connection", "close"), ("content-type", "text/plain")]),
            ["content-type"]
        );
    }

    #[test]
    fn a_name_listed_in_a_second_connection_header_is_removed_too() {
        assert_eq!(
            stripped(&[
                ("connection", "keep-alive"),
                ("connection", "x-hop"),
                ("x-hop", "1"),
                ("x-end", "2"),
            ]),
            ["x-end"]
        );
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
            &forwarded_for("127.0.0.1".parse().unwrap()),
            "http",
            Some(HeaderValue::from_static("api.example")),
        );
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 127.0.0.1");
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example");
    }

    #[test]
    fn forwarded_headers_are_set_when_the_client_sent_none() {
        let mut h = map(&[("content-type", "application/json")]);
        add_forwarded(
            &mut h,
            &forwarded_for("::1".parse().unwrap()),
            "https",
            None,
        );
        assert_eq!(h["x-forwarded-for"], "::1");
        assert_eq!(h["x-forwarded-proto"], "https");
        assert!(!h.contains_key("x-forwarded-host"));
    }

    #[test]
    fn the_length_test_lets_every_listed_name_through() {
        for n in HOP_BY_HOP {
            assert!(is_hop_by_hop(&HeaderName::from_static(n)), "{n}");
        }
        assert!(is_hop_by_hop(&HeaderName::from_static(
            "proxy-authenticate"
        )));
        assert!(!is_hop_by_hop(&HeaderName::from_static("content-type")));
        assert!(!is_hop_by_hop(&HeaderName::from_static("tx")));
    }

    #[test]
    fn a_connection_token_is_hop_by_hop_by_name_in_any_case() {
        for (n, name) in HOP_BY_HOP.iter().zip(&HOP_BY_HOP_NAMES) {
            assert!(hop_by_hop_token(n.to_ascii_uppercase().as_bytes()), "{n}");
            assert_eq!(name.as_str(), *n);
        }
        assert!(hop_by_hop_token(b"Proxy-Authorization"));
        assert!(!hop_by_hop_token(b"x-proxy-id"));
        assert!(!hop_by_hop_token(b"tee"));
        assert!(!hop_by_hop_token(b"proxy"));
        // Those are not parsed: only the other names are listed.
        let h = map(&[("connection", "Keep-Alive, UPGRADE, proxy-x, X-Hop")]);
        let listed: Vec<HeaderName> = connection_listed(&h).collect();
        assert_eq!(listed, [HeaderName::from_static("x-hop")]);
    }

    #[test]
    fn a_connection_value_with_obs_text_still_names_its_headers() {
        let mut h = map(&[("x-hop", "1"), ("x-end", "2")]);
        h.append(
            CONNECTION,
            HeaderValue::from_bytes(b"x-hop, caf\xe9").unwrap(),
        );
        assert_eq!(left(h), ["x-end"]);
    }

    #[test]
    fn proxy_headers_go_without_a_connection_header() {
        assert_eq!(
            stripped(&[
                ("proxy-authorization", "Basic x"),
                ("x-a", "1"),
                ("proxy-connection", "keep-alive"),
                ("te", "trailers"),
            ]),
            ["x-a"]
        );
    }

    #[test]
    fn a_message_without_hop_by_hop_headers_is_left_as_it_is() {
        let mut h = map(&[
            ("content-type", "application/json"),
            ("x-a", "1"),
            ("x-a", "2"),
        ]);
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
