//! Fingerprints and the canonical JSON form: unit, golden and property
//! tests.

use super::*;
use proptest::prelude::*;
use serde_json::Value;

const JSON: Option<&[u8]> = Some(b"application/json");

fn fp(body: &[u8]) -> Fingerprint {
    Fingerprint::compute(FingerprintMode::Json, "POST", "/v1/p", None, JSON, body)
}

#[test]
fn kept_inputs_match_the_same_bytes_and_nothing_else() {
    type Parts<'a> = (
        FingerprintMode,
        &'a str,
        &'a str,
        Option<&'a str>,
        Option<&'a [u8]>,
        &'a [u8],
    );
    let body: &[u8] = br#"{"amount":100}"#;
    let base: Parts = (
        FingerprintMode::Json,
        "POST",
        "/v1/p",
        Some("a=1"),
        JSON,
        body,
    );
    let kept = |p: Parts| Inputs::new(p.0, p.1, p.2, p.3, p.4, p.5);
    let matches = |i: &Inputs, p: Parts| i.matches(p.0, p.1, p.2, p.3, p.4, p.5);
    let seen = kept(base);
    assert!(matches(&seen, base));
    assert_eq!(seen.held_bytes(), 4 + 5 + 3 + 16 + body.len());
    let text: Option<&[u8]> = Some(b"text/plain");
    let other: [(&str, Parts); 8] = [
        (
            "mode",
            (
                FingerprintMode::Bytes,
                "POST",
                "/v1/p",
                Some("a=1"),
                JSON,
                body,
            ),
        ),
        (
            "method",
            (
                FingerprintMode::Json,
                "PATCH",
                "/v1/p",
                Some("a=1"),
                JSON,
                body,
            ),
        ),
        (
            "path",
            (
                FingerprintMode::Json,
                "POST",
                "/v1/q",
                Some("a=1"),
                JSON,
                body,
            ),
        ),
        (
            "no query",
            (FingerprintMode::Json, "POST", "/v1/p", None, JSON, body),
        ),
        (
            "empty query",
            (FingerprintMode::Json, "POST", "/v1/p", Some(""), JSON, body),
        ),
        (
            "content type",
            (
                FingerprintMode::Json,
                "POST",
                "/v1/p",
                Some("a=1"),
                text,
                body,
            ),
        ),
        (
            "no content type",
            (
                FingerprintMode::Json,
                "POST",
                "/v1/p",
                Some("a=1"),
                None,
                body,
            ),
        ),
        (
            "body",
            (
                FingerprintMode::Json,
                "POST",
                "/v1/p",
                Some("a=1"),
                JSON,
                br#"{"amount":101}"#,
            ),
        ),
    ];
    for (what, p) in other {
        assert!(!matches(&seen, p), "{what}");
    }
    // Same JSON, other bytes: not recognised (fingerprinted as usual).
    let spaced: &[u8] = br#"{ "amount": 100 }"#;
    assert!(!matches(
        &seen,
        (base.0, base.1, base.2, base.3, base.4, spaced)
    ));
}

proptest! {
    /// What the kept inputs recognise has the fingerprint they were kept
    /// with: inputs that match compute the same fingerprint.
    #[test]
    fn kept_inputs_that_match_have_the_same_fingerprint(
        body in proptest::collection::vec(any::<u8>(), 0..64),
        other in proptest::collection::vec(any::<u8>(), 0..64),
        json in any::<bool>(),
        same in any::<bool>(),
    ) {
        let other = if same { body.clone() } else { other };
        let ct: Option<&[u8]> = if json { JSON } else { Some(b"text/plain") };
        let seen = Inputs::new(FingerprintMode::Json, "POST", "/v1/p", None, ct, &body);
        let fp_of = |b: &[u8]| Fingerprint::compute(FingerprintMode::Json, "POST", "/v1/p", None, ct, b);
        if seen.matches(FingerprintMode::Json, "POST", "/v1/p", None, ct, &other) {
            prop_assert_eq!(&body, &other);
            prop_assert_eq!(fp_of(&body), fp_of(&other));
        } else {
            prop_assert_ne!(&body, &other);
        }
    }
}

#[test]
fn json_key_order_and_whitespace_do_not_matter() {
    assert_eq!(
        fp(br#"{"a":1,"b":{"y":[1,2],"x":"s"}}"#),
        fp(b"{ \"b\" : { \"x\" : \"s\", \"y\" : [ 1 , 2 ] },\n \"a\" : 1 }")
    );
}

#[test]
fn json_number_text_is_kept_exactly() {
    let one = fp(br#"{"n":1}"#);
    assert_ne!(one, fp(br#"{"n":1.0}"#));
    assert_ne!(one, fp(br#"{"n":1e0}"#));
    assert_ne!(fp(br#"{"n":1.0}"#), fp(br#"{"n":1.00}"#));
    assert_eq!(
        canonical_json(br#"[12345678901234567890123, 1.10]"#).unwrap(),
        br#"[12345678901234567890123,1.10]"#
    );
}

#[test]
fn json_array_order_matters() {
    assert_ne!(fp(b"[1,2]"), fp(b"[2,1]"));
}

#[test]
fn json_string_escapes_are_normalised() {
    assert_eq!(fp(br#"{"s":"\u0041"}"#), fp(br#"{"s":"A"}"#));
}

#[test]
fn invalid_json_is_hashed_as_bytes() {
    assert_eq!(canonical_json(b"{not json"), None);
    assert_ne!(fp(b"{not json"), fp(b"{not  json"));
}

#[test]
fn non_json_content_type_hashes_bytes() {
    let a = Fingerprint::compute(
        FingerprintMode::Json,
        "POST",
        "/",
        None,
        Some(b"text/plain"),
        br#"{"a":1,"b":2}"#,
    );
    let b = Fingerprint::compute(
        FingerprintMode::Json,
        "POST",
        "/",
        None,
        Some(b"text/plain"),
        br#"{"b":2,"a":1}"#,
    );
    assert_ne!(a, b);
}

#[test]
fn bytes_mode_never_canonicalises() {
    let a = Fingerprint::compute(
        FingerprintMode::Bytes,
        "POST",
        "/",
        None,
        JSON,
        br#"{"a":1,"b":2}"#,
    );
    let b = Fingerprint::compute(
        FingerprintMode::Bytes,
        "POST",
        "/",
        None,
        JSON,
        br#"{"b":2,"a":1}"#,
    );
    assert_ne!(a, b);
}

#[test]
fn method_path_and_query_are_part_of_the_fingerprint() {
    let base = Fingerprint::compute(
        FingerprintMode::Json,
        "POST",
        "/a",
        Some("x=1"),
        JSON,
        b"{}",
    );
    assert_ne!(
        base,
        Fingerprint::compute(
            FingerprintMode::Json,
            "PATCH",
            "/a",
            Some("x=1"),
            JSON,
            b"{}"
        )
    );
    assert_ne!(
        base,
        Fingerprint::compute(
            FingerprintMode::Json,
            "POST",
            "/b",
            Some("x=1"),
            JSON,
            b"{}"
        )
    );
    assert_ne!(
        base,
        Fingerprint::compute(
            FingerprintMode::Json,
            "POST",
            "/a",
            Some("x=2"),
            JSON,
            b"{}"
        )
    );
    assert_ne!(
        base,
        Fingerprint::compute(FingerprintMode::Json, "POST", "/a", None, JSON, b"{}")
    );
    // An empty query differs from no query ("/a?" vs "/a").
    assert_ne!(
        Fingerprint::compute(FingerprintMode::Json, "POST", "/a", Some(""), JSON, b"{}"),
        Fingerprint::compute(FingerprintMode::Json, "POST", "/a", None, JSON, b"{}")
    );
}

#[test]
fn framing_prevents_boundary_ambiguity() {
    let a = Fingerprint::compute(FingerprintMode::Bytes, "POST", "/ab", None, None, b"c");
    let b = Fingerprint::compute(FingerprintMode::Bytes, "POST", "/a", None, None, b"bc");
    assert_ne!(a, b);
}

#[test]
fn json_content_types_are_recognised() {
    for ct in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/merge-patch+json",
        "application/vnd.api+json",
    ] {
        assert!(is_json_content_type(Some(ct.as_bytes())), "{ct}");
    }
    for ct in [
        "text/plain",
        "application/jsonx",
        "json",
        "+json",
        "application/x-www-form-urlencoded",
    ] {
        assert!(!is_json_content_type(Some(ct.as_bytes())), "{ct}");
    }
    assert!(!is_json_content_type(None));
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-z\\u{e9}\\u{1F600}\"\\\\]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z]{0,4}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Serialises an object with its keys in reverse order and extra spaces,
/// as a different client's serialiser might.
fn reorder(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<_> = m.iter().collect();
            entries.reverse();
            let parts: Vec<String> = entries
                .into_iter()
                .map(|(k, v)| format!("{} : {}", serde_json::to_string(k).unwrap(), reorder(v)))
                .collect();
            format!("{{ {} }}", parts.join(" , "))
        }
        Value::Array(a) => format!(
            "[ {} ]",
            a.iter().map(reorder).collect::<Vec<_>>().join(", ")
        ),
        other => serde_json::to_string(other).unwrap(),
    }
}

proptest! {
    #[test]
    fn canonical_form_is_order_insensitive(v in json_value()) {
        let a = canonical_json(serde_json::to_string(&v).unwrap().as_bytes()).unwrap();
        let b = canonical_json(reorder(&v).as_bytes()).unwrap();
        prop_assert_eq!(a, b);
    }

    #[test]
    fn the_canonical_form_is_serde_jsons_sorted_compact_form(v in json_value()) {
        // serde_json's Value keeps an object's members sorted by key
        // and writes compact JSON: the reference, whatever order and
        // spacing the client used.
        let reference = serde_json::to_vec(&v).unwrap();
        prop_assert_eq!(canonical_json(reorder(&v).as_bytes()).unwrap(), reference);
    }

    #[test]
    fn canonicalisation_is_idempotent(v in json_value()) {
        let once = canonical_json(serde_json::to_string(&v).unwrap().as_bytes()).unwrap();
        let twice = canonical_json(&once).unwrap();
        prop_assert_eq!(once, twice);
    }

    #[test]
    fn different_values_have_different_canonical_forms(a in json_value(), b in json_value()) {
        let ca = canonical_json(serde_json::to_string(&a).unwrap().as_bytes()).unwrap();
        let cb = canonical_json(serde_json::to_string(&b).unwrap().as_bytes()).unwrap();
        prop_assert_eq!(a == b, ca == cb);
    }

    #[test]
    fn canonical_json_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = canonical_json(&bytes);
    }
}

/// JSON number text as clients write it: signs, fractions, exponents,
/// integers beyond 64 bits.
fn number_text() -> impl Strategy<Value = String> {
    "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,6})?([eE][+-]?[0-9]{1,3})?"
}

/// Values whose numbers are arbitrary number text (kept exactly with
/// serde_json's `arbitrary_precision`).
fn json_value_with_number_text() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number_text().prop_map(|n| serde_json::from_str::<Value>(&n).unwrap()),
        "[a-z\\u{e9}\"\\\\\\n]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::btree_map("[a-c]{0,2}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The document with JSON whitespace (space, tab, CR, LF) around every
/// token, as a pretty-printer or a hand might lay it out.
fn spaced(text: &str, seed: u64) -> String {
    let ws = [" ", "\t", "\r\n", "\n  "];
    let mut out = String::new();
    let mut in_string = false;
    let mut escaped = false;
    let mut n = seed;
    for c in text.chars() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        if matches!(c, '{' | '}' | '[' | ']' | ',' | ':') {
            n = n
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            out.push_str(ws[(n >> 33) as usize % ws.len()]);
            out.push(c);
            out.push_str(ws[(n >> 40) as usize % ws.len()]);
        } else {
            if c == '"' {
                in_string = true;
            }
            out.push(c);
        }
    }
    out
}

#[test]
fn number_text_is_kept_exactly_exponents_included() {
    // As the bytes say: every spelling is its own request.
    let forms: Vec<_> = ["1", "1.0", "1e0", "1E0", "1e+0", "1E+0", "10e-1", "0.1e1"]
        .iter()
        .map(|n| canonical_json(format!("[ {n} ]").as_bytes()).unwrap())
        .collect();
    for (i, a) in forms.iter().enumerate() {
        for b in &forms[i + 1..] {
            assert_ne!(a, b);
        }
    }
    assert_eq!(canonical_json(b"[ 1E+0 ]").unwrap(), b"[1E+0]");
}

#[test]
fn repeated_keys_keep_the_last_value_and_invalid_documents_are_refused() {
    assert_eq!(canonical_json(br#"{"a":1,"a":2}"#).unwrap(), br#"{"a":2}"#);
    for bad in [
        &b"{"[..],
        b"[1,]",
        b"{\"a\" 1}",
        b"01",
        b"nul",
        b"[1] x",
        b"\"\\ud800\"",
    ] {
        assert_eq!(
            canonical_json(bad),
            None,
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

proptest! {
    #[test]
    fn number_text_is_kept_exactly(n in number_text()) {
        let doc = format!("{{\"n\": [ {n} ]}}");
        prop_assert_eq!(
            String::from_utf8(canonical_json(doc.as_bytes()).unwrap()).unwrap(),
            format!("{{\"n\":[{n}]}}")
        );
    }

    #[test]
    fn numbers_that_differ_as_text_are_different_requests(a in number_text(), b in number_text()) {
        // Equal in value (1, 1.0, 1e0) but not in text: still different.
        let same = a == b;
        let ca = canonical_json(format!("[{a}]").as_bytes()).unwrap();
        let cb = canonical_json(format!("[{b}]").as_bytes()).unwrap();
        prop_assert_eq!(same, ca == cb);
        prop_assert_eq!(same, fp(format!("[{a}]").as_bytes()) == fp(format!("[{b}]").as_bytes()));
    }

    #[test]
    fn distinct_values_with_any_number_text_stay_distinct(
        a in json_value_with_number_text(),
        b in json_value_with_number_text(),
    ) {
        let ca = canonical_json(serde_json::to_string(&a).unwrap().as_bytes()).unwrap();
        let cb = canonical_json(serde_json::to_string(&b).unwrap().as_bytes()).unwrap();
        prop_assert_eq!(a == b, ca == cb);
    }

    #[test]
    fn whitespace_and_key_order_never_change_the_fingerprint(
        v in json_value_with_number_text(),
        seed in any::<u64>(),
    ) {
        let compact = serde_json::to_string(&v).unwrap();
        let laid_out = spaced(&reorder(&v), seed);
        prop_assert_eq!(fp(compact.as_bytes()), fp(laid_out.as_bytes()), "{}", laid_out);
        // Idempotent through the whole pipeline as well.
        let once = canonical_json(laid_out.as_bytes()).unwrap();
        prop_assert_eq!(canonical_json(&once).unwrap(), once);
    }

    #[test]
    fn escaped_and_literal_characters_are_the_same_string(s in "[a-zA-Z0-9 \\u{e9}\\u{4e2d}]{0,12}") {
        let escaped: String = s
            .encode_utf16()
            .map(|u| format!("\\u{u:04x}"))
            .collect();
        let literal = serde_json::to_string(&s).unwrap();
        prop_assert_eq!(
            canonical_json(format!("[\"{escaped}\"]").as_bytes()),
            canonical_json(format!("[{literal}]").as_bytes())
        );
    }

    // Stored fingerprints must survive an upgrade: the fast paths
    // (strings written without the serialiser, tokens without escapes
    // taken as they are) give exactly the bytes the serialiser and the
    // parser give.
    #[test]
    fn strings_are_written_exactly_as_serde_json_writes_them(s in any::<String>()) {
        let mut out = Vec::new();
        write_string(&mut out, &s);
        prop_assert_eq!(out, serde_json::to_vec(&s).unwrap());
    }

    #[test]
    fn string_tokens_decode_exactly_as_serde_json_decodes_them(s in any::<String>()) {
        // Both forms of the string: serde_json's escaping, and (when it
        // is valid JSON) the raw text in quotes.
        let escaped = serde_json::to_string(&s).unwrap();
        let raw = format!("\"{s}\"");
        for token in [escaped, raw] {
            let expected = serde_json::from_str::<String>(&token).ok();
            if expected.is_none() {
                continue;
            }
            let mut walker = Walker::new(token.as_bytes());
            let got = walker.string().map(Cow::into_owned);
            prop_assert_eq!(got, expected);
            prop_assert_eq!(walker.at, token.len());
        }
    }
}

#[test]
fn nested_unsorted_objects_and_repeated_keys_are_canonical() {
    // Inner objects are put in order before their parent is; a
    // repeated key keeps its last value wherever the first one sat.
    let cases: [(&str, &str); 5] = [
        (
            r#"{"b":{"d":1,"c":{"f":2,"e":3}},"a":[{"z":1,"y":2}],"b":3}"#,
            r#"{"a":[{"y":2,"z":1}],"b":3}"#,
        ),
        (
            r#"{"b":1,"a":{"y":[{"q":1,"p":2}],"x":0},"b":{"n":1,"m":2}}"#,
            r#"{"a":{"x":0,"y":[{"p":2,"q":1}]},"b":{"m":2,"n":1}}"#,
        ),
        (r#"{"a":1,"b":2,"a":3}"#, r#"{"a":3,"b":2}"#),
        (r#"{"a":1,"a":2,"a":3}"#, r#"{"a":3}"#),
        (r#"{ }"#, r#"{}"#),
    ];
    for (input, canonical) in cases {
        assert_eq!(
            String::from_utf8(canonical_json(input.as_bytes()).unwrap()).unwrap(),
            canonical,
            "{input}"
        );
    }
}

#[test]
fn canonical_forms_are_unchanged() {
    // Canonical forms as released: a change here changes stored
    // fingerprints, and every retry after an upgrade would get 422.
    let cases: [(&str, &str); 6] = [
        (r#"{"b":1,"a":"x"}"#, r#"{"a":"x","b":1}"#),
        (
            r#" { "z" : [ 1 , 2.50 , -3e2 ] , "a" : { "y" : null , "x" : true } } "#,
            r#"{"a":{"x":true,"y":null},"z":[1,2.50,-3e2]}"#,
        ),
        (
            r#"{"k":"caf\u00e9 \"q\" \\ \/ \n\t\u0001"}"#,
            r#"{"k":"café \"q\" \\ / \n\t\u0001"}"#,
        ),
        (r#"{"\u0062":1,"a":2}"#, r#"{"a":2,"b":1}"#),
        (r#"["中文","é",""]"#, r#"["中文","é",""]"#),
        (r#"{"a":1,"a":2}"#, r#"{"a":2}"#),
    ];
    for (input, canonical) in cases {
        assert_eq!(
            String::from_utf8(canonical_json(input.as_bytes()).unwrap()).unwrap(),
            canonical,
            "{input}"
        );
    }
}
