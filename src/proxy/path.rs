//! The normal form of a request path, which routes are matched on, the
//! fingerprint is computed over, and the upstream is sent.
//!
//! Why: route rules (`key = "required"`, `tenant_required`) bind only if
//! every spelling of a path meets the route it names. `//v1/payments/x`,
//! `/v1/%70ayments/x` and `/v1/./payments/x` are `/v1/payments/x` to an
//! upstream that normalises, so they are to us (RFC 3986 §6.2.2): percent-
//! encoded unreserved characters decoded, other escapes' hex in upper case,
//! dot segments resolved (§5.2.4), and empty segments collapsed (not RFC
//! 3986, but what most servers and frameworks do with `//`).
//!
//! The normal form is what is forwarded, not the original: the upstream
//! then executes exactly the path whose rules were applied, whatever its
//! own normalisation, and a retry spelled differently fingerprints as the
//! same request.
//!
//! Two spellings stay ambiguous and are refused (`400 ambiguous-path`):
//! `..` above the root (servers clamp it, refuse it or serve a parent
//! directory), and an encoded slash (`%2F`, or `%5C`/`\`, which some servers
//! read as `/`) whose decoding would change the route. An encoded slash that
//! changes no route is passed on as it is: identifiers with a `/` in them
//! are legitimate.

use std::borrow::Cow;

/// Why a path has no single meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ambiguous {
    /// A `..` that would climb above the root.
    AboveRoot,
    /// An encoded slash whose decoding changes the route.
    EncodedSlash,
    /// Escapes nested so deep that decoding keeps making new ones.
    NestedEscapes,
}

impl Ambiguous {
    /// What the client is told.
    pub(super) fn detail(self) -> &'static str {
        match self {
            Ambiguous::AboveRoot => "the path climbs above the root with \"..\"; nothing was stored or forwarded",
            Ambiguous::EncodedSlash => "the path has an encoded \"/\" (%2F) or \"\\\" whose meaning depends on the server that decodes it, and it changes the route; nothing was stored or forwarded",
            Ambiguous::NestedEscapes => "the path's percent-escapes decode to further escapes; nothing was stored or forwarded",
        }
    }
}

/// RFC 3986 §2.3: ALPHA / DIGIT / "-" / "." / "_" / "~".
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Percent-escapes of unreserved characters decoded, the hex of the others
/// in upper case; anything else (malformed escapes included) unchanged.
fn decode_unreserved(path: &str) -> Cow<'_, str> {
    let bytes = path.as_bytes();
    if !bytes.contains(&b'%') {
        return Cow::Borrowed(path);
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let decoded = h << 4 | l;
                if unreserved(decoded) {
                    out.push(decoded);
                } else {
                    out.push(b'%');
                    out.push(bytes[i + 1].to_ascii_uppercase());
                    out.push(bytes[i + 2].to_ascii_uppercase());
                }
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    // Only ASCII was replaced by ASCII: still UTF-8.
    Cow::Owned(String::from_utf8(out).unwrap_or_else(|_| path.to_owned()))
}

/// Dot segments resolved and empty segments collapsed; a trailing `/` (or a
/// final `.`/`..`, RFC 3986 §5.2.4) kept as a trailing `/`.
fn resolve_segments(path: &str) -> Result<String, Ambiguous> {
    let mut stack: Vec<&str> = Vec::new();
    let mut trailing = false;
    for segment in path.split('/').skip(1) {
        trailing = matches!(segment, "" | "." | "..");
        match segment {
            "" | "." => {}
            ".." => {
                stack.pop().ok_or(Ambiguous::AboveRoot)?;
            }
            s => stack.push(s),
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &stack {
        out.push('/');
        out.push_str(s);
    }
    if trailing || stack.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// The normal form of `path`. A path that does not start with `/` (the
/// asterisk form of `OPTIONS *`) is returned as it is.
///
/// Decoding can make a new escape (`%%37%30` → `%70`), which a server
/// that decodes once more would read as `p`: passes repeat until nothing
/// changes, and a path still changing after a few is refused.
pub(super) fn normalise(path: &str) -> Result<Cow<'_, str>, Ambiguous> {
    if !path.starts_with('/') || is_plain(path) {
        return Ok(Cow::Borrowed(path));
    }
    let mut current = Cow::Borrowed(path);
    for _ in 0..4 {
        let next = resolve_segments(&decode_unreserved(&current))?;
        if next == *current {
            return Ok(current);
        }
        current = Cow::Owned(next);
    }
    Err(Ambiguous::NestedEscapes)
}

/// Whether `path` (starting with `/`) is already in normal form because
/// there is nothing to normalise: no escape, no empty segment but a
/// trailing one, no dot segment. Nearly every request's path is; one pass
/// over its bytes spares it the general algorithm's allocations.
fn is_plain(path: &str) -> bool {
    let bytes = path.as_bytes();
    let mut segment_start = 1;
    for i in 1..=bytes.len() {
        let end = i == bytes.len();
        if !end && bytes[i] == b'%' {
            return false;
        }
        if end || bytes[i] == b'/' {
            match &bytes[segment_start..i] {
                // An empty segment is normal only as the trailing one.
                b"" if !end => return false,
                b"." | b".." => return false,
                _ => {}
            }
            segment_start = i + 1;
        }
    }
    true
}

/// The normal form with encoded slashes (and backslashes) read as `/`: what
/// a server that decodes them before routing would see. `None` when the
/// path has none.
pub(super) fn with_slashes_decoded(normal: &str) -> Option<Result<String, Ambiguous>> {
    // Escapes are upper case in the normal form; one pass for all three.
    let has_slash = normal.as_bytes().iter().enumerate().any(|(i, &b)| {
        b == b'\\'
            || (b == b'%' && matches!(normal.as_bytes().get(i + 1..i + 3), Some(b"2F" | b"5C")))
    });
    if !has_slash {
        return None;
    }
    let slashed = normal
        .replace("%2F", "/")
        .replace("%5C", "/")
        .replace('\\', "/");
    Some(normalise(&slashed).map(Cow::into_owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(path: &str) -> String {
        normalise(path).unwrap().into_owned()
    }

    #[test]
    fn normal_paths_are_borrowed_unchanged() {
        for p in ["/", "/v1/payments", "/v1/payments/", "/a%2Fb", "/caf\u{e9}"] {
            assert!(
                matches!(normalise(p), Ok(Cow::Borrowed(q)) if q == p),
                "{p}"
            );
        }
    }

    #[test]
    fn the_plain_fast_path_agrees_with_the_general_algorithm() {
        let paths = [
            "/", "/a", "/a/", "/a/b", "/a//b", "//", "/.", "/..", "/a/.", "/a/..", "/a/./b",
            "/a/../b", "/.a", "/a.", "/..a/b", "/a/b..", "/%41", "/a%2Fb", "/a/b/", "///",
        ];
        for p in paths {
            let mut general = p.to_owned();
            while let Ok(next) = resolve_segments(&decode_unreserved(&general)) {
                if next == general {
                    break;
                }
                general = next;
            }
            if is_plain(p) {
                assert_eq!(
                    general, p,
                    "{p} is called plain but normalises to {general}"
                );
            }
        }
        assert!(is_plain("/v1/orders") && is_plain("/v1/orders/") && is_plain("/"));
        assert!(!is_plain("//v1") && !is_plain("/v1/./x") && !is_plain("/v1/%70"));
    }

    #[test]
    fn empty_segments_collapse() {
        assert_eq!(n("//v1/payments/x"), "/v1/payments/x");
        assert_eq!(n("/v1//payments///x"), "/v1/payments/x");
        assert_eq!(n("/v1/payments//"), "/v1/payments/");
        assert_eq!(n("//"), "/");
    }

    #[test]
    fn encoded_unreserved_characters_are_decoded_and_other_escapes_upper_cased() {
        assert_eq!(n("/v1/%70ayments/x"), "/v1/payments/x");
        assert_eq!(n("/v1/%70%61yments/%7e%2D%5f%2e"), "/v1/payments/~-_.");
        assert_eq!(n("/a%2fb%3a"), "/a%2Fb%3A");
        // Malformed escapes are left alone.
        assert_eq!(n("/a%zz/%"), "/a%zz/%");
        assert_eq!(n("/a%4"), "/a%4");
    }

    #[test]
    fn dot_segments_are_resolved_encoded_or_not() {
        assert_eq!(n("/v1/./payments/x"), "/v1/payments/x");
        assert_eq!(n("/v1/orders/../payments/x"), "/v1/payments/x");
        assert_eq!(n("/v1/orders/%2e%2E/payments/x"), "/v1/payments/x");
        assert_eq!(n("/v1/payments/."), "/v1/payments/");
        assert_eq!(n("/v1/payments/x/.."), "/v1/payments/");
        assert_eq!(n("/v1/.."), "/");
        // Not dot segments.
        assert_eq!(n("/v1/...x/.a"), "/v1/...x/.a");
    }

    #[test]
    fn climbing_above_the_root_is_ambiguous() {
        for p in ["/..", "/../v1", "/v1/../../v1", "/%2e%2e/x"] {
            assert_eq!(normalise(p), Err(Ambiguous::AboveRoot), "{p}");
        }
    }

    #[test]
    fn escapes_that_decode_to_escapes_are_decoded_again() {
        assert_eq!(n("/v1/%%37%30ayments"), "/v1/payments");
    }

    #[test]
    fn the_asterisk_form_is_left_alone() {
        assert_eq!(n("*"), "*");
    }

    #[test]
    fn encoded_slashes_are_read_as_slashes_only_for_the_ambiguity_check() {
        assert_eq!(with_slashes_decoded("/v1/payments/x"), None);
        assert_eq!(
            with_slashes_decoded(&n("/v1%2fpayments/x")),
            Some(Ok("/v1/payments/x".to_owned()))
        );
        assert_eq!(
            with_slashes_decoded("/v1%5Cpayments"),
            Some(Ok("/v1/payments".to_owned()))
        );
        assert_eq!(
            with_slashes_decoded("/x%2F..%2F..%2Fy"),
            Some(Err(Ambiguous::AboveRoot))
        );
    }

    proptest::proptest! {
        /// Normalising is idempotent, and the normal form never has an
        /// empty or dot segment.
        #[test]
        fn the_normal_form_is_a_fixed_point(
            segs in proptest::collection::vec("(\\.|\\.\\.|%2[eE]|%70|%2[fF]|a|~|%|)", 0..8),
        ) {
            let path = format!("/{}", segs.join("/"));
            if let Ok(once) = normalise(&path) {
                let twice = normalise(&once).unwrap();
                proptest::prop_assert_eq!(&once, &twice);
                let inner = once.trim_end_matches('/');
                proptest::prop_assert!(
                    !inner.split('/').skip(1).any(|s| matches!(s, "" | "." | "..")),
                    "{:?}", once
                );
            }
        }
    }
}
