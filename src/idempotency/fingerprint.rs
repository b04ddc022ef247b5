//! Request fingerprints: SHA-256 over method, path, query and body.
//!
//! A retry must carry the same request as the original. The fingerprint is
//! what "the same" means: method, path, query and body, each length-framed
//! so that no two different requests can produce the same hashed stream.
//! JSON bodies are canonicalised first (object keys sorted, insignificant
//! whitespace removed, every value kept exactly — number text included, so
//! `1` and `1.0` differ), so a client whose serialiser reorders keys still
//! matches. A body that claims to be JSON but does not parse is hashed as
//! raw bytes.

use std::borrow::Cow;
use std::fmt;

use sha2::{Digest, Sha256};

/// How a request body is fed into the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FingerprintMode {
    /// JSON bodies are canonicalised (keys sorted, whitespace removed,
    /// values kept exactly); other bodies are hashed as bytes.
    Json,
    /// Bodies are always hashed as bytes.
    Bytes,
}

/// The SHA-256 fingerprint of a request.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint of a request.
    pub fn compute(
        mode: FingerprintMode,
        method: &str,
        path: &str,
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        let mut h = Sha256::new();
        h.update(b"idemproxy/fingerprint/v1");
        frame(&mut h, method.as_bytes());
        frame(&mut h, path.as_bytes());
        match query {
            None => h.update([0u8]),
            Some(q) => {
                h.update([1u8]);
                frame(&mut h, q.as_bytes());
            }
        }
        let canonical = match mode {
            FingerprintMode::Json if is_json_content_type(content_type) => canonical_json(body),
            _ => None,
        };
        match canonical {
            Some(c) => {
                h.update([b'j']);
                frame(&mut h, &c);
            }
            None => {
                h.update([b'b']);
                frame(&mut h, body);
            }
        }
        Fingerprint(h.finalize().into())
    }

    /// Rebuilds a fingerprint from its stored bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Fingerprint)
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// Everything [`Fingerprint::compute`] reads, kept (copied) to recognise
/// the same request again: inputs equal byte for byte have the same
/// fingerprint, so a request that [`matches`](Self::matches) a request whose
/// fingerprint is known has that fingerprint without canonicalising and
/// hashing its body again. A request with other bytes (keys reordered,
/// whitespace) is not recognised and is fingerprinted as usual.
#[derive(Clone, PartialEq, Eq)]
pub struct Inputs {
    mode: FingerprintMode,
    method: Box<str>,
    path: Box<str>,
    query: Option<Box<str>>,
    content_type: Option<Box<[u8]>>,
    body: Box<[u8]>,
}

impl Inputs {
    /// Copies a request's inputs (nothing is shared with its buffers).
    pub fn new(
        mode: FingerprintMode,
        method: &str,
        path: &str,
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        Inputs {
            mode,
            method: method.into(),
            path: path.into(),
            query: query.map(Into::into),
            content_type: content_type.map(Into::into),
            body: body.into(),
        }
    }

    /// Whether a request's inputs are these, byte for byte. The content
    /// type is compared even where the mode ignores it: a stricter test
    /// can only send a request down the usual path.
    pub fn matches(
        &self,
        mode: FingerprintMode,
        method: &str,
        path: &str,
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> bool {
        self.mode == mode
            && *self.body == *body
            && *self.path == *path
            && self.query.as_deref() == query
            && *self.method == *method
            && self.content_type.as_deref() == content_type
    }

    /// The bytes held, for a cache's budget.
    pub fn held_bytes(&self) -> usize {
        self.method.len()
            + self.path.len()
            + self.query.as_ref().map_or(0, |q| q.len())
            + self.content_type.as_ref().map_or(0, |c| c.len())
            + self.body.len()
    }
}

impl fmt::Debug for Inputs {
    /// The body's length only: a body may hold what logs must not.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inputs")
            .field("mode", &self.mode)
            .field("method", &self.method)
            .field("body_len", &self.body.len())
            .finish_non_exhaustive()
    }
}

fn frame(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// `application/json` or any `type/subtype+json`, parameters ignored.
pub fn is_json_content_type(content_type: Option<&[u8]>) -> bool {
    let Some(ct) = content_type.and_then(|c| std::str::from_utf8(c).ok()) else {
        return false;
    };
    // Compared without case and without a lowercased copy: this runs on
    // every keyed request.
    let essence = ct.split(';').next().unwrap_or("").trim();
    let Some((ty, sub)) = essence.split_once('/') else {
        return false;
    };
    if ty.is_empty() || sub.is_empty() {
        return false;
    }
    let sub = sub.as_bytes();
    essence.eq_ignore_ascii_case("application/json")
        || (sub.len() >= 5 && sub[sub.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// The canonical form of a JSON document, or `None` if it does not parse.
///
/// Object keys are sorted by their bytes, insignificant whitespace removed,
/// strings re-escaped the one way serde_json writes them (`"\u0041"` and
/// `"A"` are one string), and numbers copied as their exact source text:
/// `1`, `1.0`, `1e0` and `1E0` are four different requests, as the bytes
/// say. If an object repeats a key, the last value wins, as in most JSON
/// parsers.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    // serde_json decides what is JSON (grammar, UTF-8, escapes, depth); the
    // walk below then only ever sees valid documents.
    serde_json::from_slice::<serde::de::IgnoredAny>(body).ok()?;
    let mut walker = Walker::new(body);
    let mut out = Vec::with_capacity(body.len());
    walker.value(&mut out, 0)?;
    walker.skip_ws();
    (walker.at == body.len()).then_some(out)
}

/// Nesting deeper than this is not canonicalised (serde_json refuses it
/// first; this keeps the walk's recursion bounded on its own).
const MAX_DEPTH: usize = 128;

/// A cursor over a document serde_json has already validated.
struct Walker<'a> {
    src: &'a [u8],
    at: usize,
    /// The members of the objects being walked, innermost last: each
    /// object uses the part above where its parent's ended.
    members: Vec<Member<'a>>,
    /// Where an object's members are copied to be written again in order.
    scratch: Vec<u8>,
}

/// One member of an object: its key and where `"key":value` was written
/// in the output.
struct Member<'a> {
    key: Cow<'a, str>,
    start: usize,
    end: usize,
}

impl<'a> Walker<'a> {
    fn new(src: &'a [u8]) -> Self {
        Walker {
            src,
            at: 0,
            members: Vec::new(),
            scratch: Vec::new(),
        }
    }

    fn skip_ws(&mut self) {
        while matches!(self.src.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.skip_ws();
        if self.src.get(self.at) == Some(&byte) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.skip_ws();
        match *self.src.get(self.at)? {
            b'{' => self.object(out, depth),
            b'[' => self.array(out, depth),
            b'"' => {
                let s = self.string()?;
                write_string(out, &s);
                Some(())
            }
            _ => {
                // Numbers and literals: copied verbatim.
                let start = self.at;
                while matches!(
                    self.src.get(self.at),
                    Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E' | b'a'..=b'z')
                ) {
                    self.at += 1;
                }
                (self.at > start).then(|| out.extend_from_slice(&self.src[start..self.at]))
            }
        }
    }

    /// A string token, decoded. Without a backslash the token's inner
    /// bytes are the string itself (the validation saw that they are UTF-8
    /// and hold no control character), borrowed; only a token with escapes
    /// is decoded, by serde_json.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        let start = self.at;
        self.at += 1;
        let mut escaped = false;
        loop {
            match *self.src.get(self.at)? {
                b'\\' => {
                    escaped = true;
                    self.at += 2;
                }
                b'"' => break,
                _ => self.at += 1,
            }
        }
        self.at += 1;
        let src: &'a [u8] = self.src;
        let token = &src[start..self.at];
        if escaped {
            serde_json::from_slice(token).ok().map(Cow::Owned)
        } else {
            std::str::from_utf8(&token[1..token.len() - 1])
                .ok()
                .map(Cow::Borrowed)
        }
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.at += 1;
        out.push(b'[');
        if !self.eat(b']') {
            loop {
                self.value(out, depth + 1)?;
                if self.eat(b']') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
                out.push(b',');
            }
        }
        out.push(b']');
        Some(())
    }

    /// An object, its members sorted by key bytes (UTF-8 order is byte
    /// order); a repeated key keeps its last value. The members are
    /// written out as they come; only an object whose keys were not
    /// already in strictly ascending order is then rewritten in order,
    /// through one scratch buffer the whole walk shares: no allocation
    /// per member or per object.
    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.at += 1;
        out.push(b'{');
        let base = self.members.len();
        let first = out.len();
        if !self.eat(b'}') {
            loop {
                self.skip_ws();
                let start = out.len();
                let key = self.string()?;
                if !self.eat(b':') {
                    return None;
                }
                write_string(out, &key);
                out.push(b':');
                self.value(out, depth + 1)?;
                self.members.push(Member {
                    key,
                    start,
                    end: out.len(),
                });
                if self.eat(b'}') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
                out.push(b',');
            }
        }
        let members = &mut self.members[base..];
        if !members.windows(2).all(|m| m[0].key < m[1].key) {
            // Stable: of equal keys the last stays last.
            members.sort_by(|a, b| a.key.cmp(&b.key));
            self.scratch.clear();
            self.scratch.extend_from_slice(&out[first..]);
            out.truncate(first);
            let mut written = false;
            for (i, m) in members.iter().enumerate() {
                if members.get(i + 1).is_some_and(|next| next.key == m.key) {
                    continue;
                }
                if written {
                    out.push(b',');
                }
                out.extend_from_slice(&self.scratch[m.start - first..m.end - first]);
                written = true;
            }
        }
        self.members.truncate(base);
        out.push(b'}');
        Some(())
    }
}

/// `s` as a JSON string, escaped the one way serde_json escapes: only `"`,
/// `\\` and the control characters U+0000–U+001F. A string with none of
/// them (almost every one) is its bytes in quotes, written without going
/// through the serialiser.
fn write_string(out: &mut Vec<u8>, s: &str) {
    if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    // Serialising a &str to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests;
