//! Where a key is: spans to lines, and the report of unknown keys.
//!
//! serde tells which keys no raw field took (through `serde_ignored`) and
//! where a type error is, but not the line of a key; a second, lossless
//! parse of the same text (`toml::de::DeTable`) gives the span of every key
//! and value. It is only made when something is wrong, so a valid file is
//! parsed once.

use std::fmt::Write as _;
use std::ops::Range;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::raw::RawConfig;
use super::{ConfigError, Problem};

/// The raw file plus every key in it that no raw field took.
pub(super) struct Deserialized {
    pub(super) config: RawConfig,
    pub(super) unknown_keys: Vec<Problem>,
}

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Deserialises `text` into the raw structs, collecting every unknown key.
pub(super) fn deserialize(text: &str, origin: &str) -> Result<Deserialized, ConfigError> {
    let mut unknown = Vec::new();
    let result = toml::Deserializer::parse(text).and_then(|de| {
        serde_ignored::deserialize(de, |path| {
            let mut segments = Vec::new();
            collect_segments(&path, &mut segments);
            unknown.push(segments);
        })
    });
    // Spans of keys come from a second, lossless parse; only needed when
    // something is wrong.
    let document = if unknown.is_empty() && result.is_ok() {
        None
    } else {
        document(text)
    };
    let mut problems: Vec<Problem> = unknown
        .iter()
        .map(|segments| Problem {
            origin: origin.to_string(),
            line: document
                .as_ref()
                .and_then(|doc| span_of(doc, segments))
                .map(|span| line_of(text, span.start)),
            key: dotted(segments),
            message: "unknown key (see docs/configuration.md for the valid keys)".to_string(),
        })
        .collect();
    match result {
        Ok(config) => Ok(Deserialized {
            config,
            unknown_keys: problems,
        }),
        Err(err) => {
            let span = err.span();
            let key = match (&document, &span) {
                (Some(doc), Some(span)) => {
                    let mut path = Vec::new();
                    path_at(doc, span.start, &mut path);
                    dotted(&path)
                }
                _ => String::new(),
            };
            problems.push(Problem {
                origin: origin.to_string(),
                line: span.map(|span| line_of(text, span.start)),
                key,
                message: err.message().to_string(),
            });
            Err(ConfigError::sorted(problems))
        }
    }
}

/// Flattens a `serde_ignored` path into key and index steps.
fn collect_segments(path: &serde_ignored::Path<'_>, out: &mut Vec<Segment>) {
    use serde_ignored::Path as P;
    match path {
        P::Root => {}
        P::Seq { parent, index } => {
            collect_segments(parent, out);
            out.push(Segment::Index(*index));
        }
        P::Map { parent, key } => {
            collect_segments(parent, out);
            out.push(Segment::Key(key.clone()));
        }
        P::Some { parent } | P::NewtypeStruct { parent } | P::NewtypeVariant { parent } => {
            collect_segments(parent, out);
        }
    }
}

/// `route[1].lease`; keys that are not bare TOML keys are quoted.
fn dotted(segments: &[Segment]) -> String {
    let mut out = String::new();
    for segment in segments {
        match segment {
            Segment::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                let bare = !key.is_empty()
                    && key
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                if bare {
                    out.push_str(key);
                } else {
                    let _ = write!(out, "{key:?}");
                }
            }
            Segment::Index(index) => {
                let _ = write!(out, "[{index}]");
            }
        }
    }
    out
}

/// The document with the span of every key and value.
fn document(text: &str) -> Option<DeValue<'_>> {
    DeTable::parse(text)
        .ok()
        .map(|table| DeValue::Table(table.into_inner()))
}

/// The span of the key (or array item) at `segments`.
fn span_of(document: &DeValue<'_>, segments: &[Segment]) -> Option<Range<usize>> {
    let mut value = document;
    let mut span = None;
    for segment in segments {
        match (segment, value) {
            (Segment::Key(wanted), DeValue::Table(table)) => {
                let (key, next) = table.iter().find(|(key, _)| key.get_ref() == wanted)?;
                span = Some(key.span());
                value = next.get_ref();
            }
            (Segment::Index(index), DeValue::Array(array)) => {
                let next = array.get(*index)?;
                span = Some(next.span());
                value = next.get_ref();
            }
            _ => return None,
        }
    }
    span
}

/// Fills `path` with the deepest key whose value covers `offset` (table
/// values only span their `[header]`, so every child is searched).
fn path_at(value: &DeValue<'_>, offset: usize, path: &mut Vec<Segment>) -> bool {
    let children: Vec<(Segment, &Spanned<DeValue<'_>>)> = match value {
        DeValue::Table(table) => table
            .iter()
            .map(|(key, child)| (Segment::Key(key.get_ref().to_string()), child))
            .collect(),
        DeValue::Array(array) => array
            .iter()
            .enumerate()
            .map(|(index, child)| (Segment::Index(index), child))
            .collect(),
        _ => return false,
    };
    for (segment, child) in children {
        path.push(segment);
        if path_at(child.get_ref(), offset, path) || child.span().contains(&offset) {
            return true;
        }
        path.pop();
    }
    false
}

/// The span of the `index`th `[[route]]` header, for a problem about a key
/// the route leaves out.
pub(super) fn route_span(text: &str, index: usize) -> Option<Range<usize>> {
    let document = document(text)?;
    span_of(
        &document,
        &[Segment::Key("route".to_string()), Segment::Index(index)],
    )
}

/// The 1-based line of a byte offset.
pub(super) fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()
        .iter()
        .take(offset)
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The 1-based line of `section.key` in `text`, or of `route[index].key`
/// when `index` is given; `None` when the file does not set it.
pub(super) fn line_of_key(
    text: &str,
    section: &str,
    index: Option<usize>,
    key: &str,
) -> Option<usize> {
    let document = document(text)?;
    let mut path = vec![Segment::Key(section.to_string())];
    path.extend(index.map(Segment::Index));
    path.push(Segment::Key(key.to_string()));
    span_of(&document, &path).map(|span| line_of(text, span.start))
}
