//! Idempotency keys: parsing and validation of the key header.
//!
//! A key is 1..=`max_key_length` bytes of visible ASCII (0x21–0x7E). The
//! IETF draft sends it as a structured-field string (`"abc"`); plain
//! `abc` is accepted too, as most clients send it that way.

use std::fmt;

use thiserror::Error;

/// A validated idempotency key, exactly as the client meant it (the quotes
/// of the structured-field form removed).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a key header was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KeyError {
    /// The header is present but empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// Longer than the route's `max_key_length`.
    #[error("the idempotency key is {len} bytes long; the limit is {max}")]
    TooLong {
        /// Length of the key sent.
        len: usize,
        /// The route's limit.
        max: usize,
    },
    /// A byte outside 0x21–0x7E.
    #[error("the idempotency key must be visible ASCII (0x21-0x7E); byte {byte:#04x} at offset {offset} is not")]
    InvalidByte {
        /// The offending byte.
        byte: u8,
        /// Its position in the key.
        offset: usize,
    },
    /// Starts with a quote but is not a valid structured-field string.
    #[error("the idempotency key starts with a quote but is not a valid structured-field string")]
    MalformedQuoted,
    /// The header was sent more than once.
    #[error("the idempotency key header was sent more than once")]
    Repeated,
}

impl IdempotencyKey {
    /// Parses a key header value: the structured-field string form
    /// (`"abc"`) or the bare form (`abc`).
    pub fn parse(raw: &[u8], max_len: usize) -> Result<Self, KeyError> {
        let raw = trim_ows(raw);
        let key: Vec<u8> = if raw.first() == Some(&b'"') {
            let item = sfv::Parser::new(raw)
                .parse::<sfv::Item>()
                .map_err(|_| KeyError::MalformedQuoted)?;
            if !item.params.is_empty() {
                return Err(KeyError::MalformedQuoted);
            }
            match item.bare_item.as_string() {
                Some(s) => s.as_str().as_bytes().to_vec(),
                None => return Err(KeyError::MalformedQuoted),
            }
        } else {
            raw.to_vec()
        };
        Self::validate(&key, max_len)?;
        // Validated as ASCII just above.
        String::from_utf8(key)
            .map(IdempotencyKey)
            .map_err(|_| KeyError::MalformedQuoted)
    }

    fn validate(key: &[u8], max_len: usize) -> Result<(), KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if let Some((offset, &byte)) = key
            .iter()
            .enumerate()
            .find(|(_, b)| !(0x21..=0x7e).contains(*b))
        {
            return Err(KeyError::InvalidByte { byte, offset });
        }
        if key.len() > max_len {
            return Err(KeyError::TooLong {
                len: key.len(),
                max: max_len,
            });
        }
        Ok(())
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// HTTP allows optional whitespace around a field value; hyper keeps none,
/// but a value built by hand might.
fn trim_ows(raw: &[u8]) -> &[u8] {
    let start = raw
        .iter()
        .position(|b| *b != b' ' && *b != b'\t')
        .unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| *b != b' ' && *b != b'\t')
        .map_or(start, |p| p + 1);
    &raw[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bare_key_is_accepted_as_is() {
        let k = IdempotencyKey::parse(b"order-123_ABC.~!", 255).unwrap();
        assert_eq!(k.as_str(), "order-123_ABC.~!");
    }

    #[test]
    fn quoted_structured_field_form_is_unquoted() {
        let k = IdempotencyKey::parse(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#, 255).unwrap();
        assert_eq!(k.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
    }

    #[test]
    fn quoted_and_bare_forms_name_the_same_key() {
        assert_eq!(
            IdempotencyKey::parse(br#""abc""#, 255).unwrap(),
            IdempotencyKey::parse(b"abc", 255).unwrap()
        );
    }

    #[test]
    fn empty_key_is_refused() {
        assert_eq!(IdempotencyKey::parse(b"", 255), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(br#""""#, 255), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"   ", 255), Err(KeyError::Empty));
    }

    #[test]
    fn key_longer_than_limit_is_refused_and_at_limit_is_accepted() {
        let at = "a".repeat(255);
        assert!(IdempotencyKey::parse(at.as_bytes(), 255).is_ok());
        let over = "a".repeat(256);
        assert_eq!(
            IdempotencyKey::parse(over.as_bytes(), 255),
            Err(KeyError::TooLong { len: 256, max: 255 })
        );
    }

    #[test]
    fn space_inside_key_is_refused_even_when_quoted() {
        assert!(matches!(
            IdempotencyKey::parse(b"a b", 255),
            Err(KeyError::InvalidByte {
                byte: b' ',
                offset: 1
            })
        ));
        assert!(matches!(
            IdempotencyKey::parse(br#""a b""#, 255),
            Err(KeyError::InvalidByte { byte: b' ', .. })
        ));
    }

    #[test]
    fn non_ascii_and_control_bytes_are_refused() {
        assert!(matches!(
            IdempotencyKey::parse("ключ".as_bytes(), 255),
            Err(KeyError::InvalidByte { .. })
        ));
        assert!(matches!(
            IdempotencyKey::parse(b"a\x7fb", 255),
            Err(KeyError::InvalidByte { byte: 0x7f, .. })
        ));
        assert!(matches!(
            IdempotencyKey::parse(b"a\x01", 255),
            Err(KeyError::InvalidByte { byte: 0x01, .. })
        ));
    }

    #[test]
    fn malformed_quoted_forms_are_refused() {
        for raw in [
            &br#""abc"#[..],
            br#""abc";p=1"#,
            br#""abc" "def""#,
            br#""a\x""#,
        ] {
            assert_eq!(
                IdempotencyKey::parse(raw, 255),
                Err(KeyError::MalformedQuoted),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(
            IdempotencyKey::parse(b"  abc\t", 255).unwrap().as_str(),
            "abc"
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..300), max in 1usize..300) {
            let _ = IdempotencyKey::parse(&raw, max);
        }

        #[test]
        fn every_visible_ascii_key_within_limit_round_trips(key in "[!-~]{1,64}") {
            let parsed = IdempotencyKey::parse(key.as_bytes(), 64);
            if key.starts_with('"') {
                // A leading quote selects the structured-field form.
                prop_assert!(parsed.is_err() || parsed.unwrap().as_str() != key);
            } else {
                let parsed = parsed.unwrap();
                prop_assert_eq!(parsed.as_str(), key.as_str());
            }
        }

        #[test]
        fn accepted_keys_are_always_visible_ascii_within_limit(raw in proptest::collection::vec(any::<u8>(), 0..80), max in 1usize..80) {
            if let Ok(k) = IdempotencyKey::parse(&raw, max) {
                prop_assert!(!k.as_str().is_empty());
                prop_assert!(k.as_str().len() <= max);
                prop_assert!(k.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
            }
        }
    }

    proptest! {
        #[test]
        fn quoted_and_bare_forms_are_the_same_key(key in "[!#-\\[\\]-~]{1,64}") {
            // No quote or backslash inside: the structured-field string is
            // just the key in quotes.
            prop_assume!(!key.starts_with('"'));
            let bare = IdempotencyKey::parse(key.as_bytes(), 64).unwrap();
            let quoted = IdempotencyKey::parse(format!("\"{key}\"").as_bytes(), 64).unwrap();
            prop_assert_eq!(bare, quoted);
        }

        #[test]
        fn optional_whitespace_around_a_key_is_ignored(
            key in "[!-~]{1,32}",
            before in "[ \t]{0,3}",
            after in "[ \t]{0,3}",
        ) {
            prop_assume!(!key.starts_with('"'));
            let padded = format!("{before}{key}{after}");
            prop_assert_eq!(
                IdempotencyKey::parse(padded.as_bytes(), 64),
                IdempotencyKey::parse(key.as_bytes(), 64)
            );
        }

        #[test]
        fn a_byte_outside_visible_ascii_is_refused_where_it_is(
            prefix in "[!#-~]{0,10}",
            bad in any::<u8>().prop_filter("not visible ASCII", |b| !(0x21..=0x7e).contains(b)),
            suffix in "[!-~]{1,10}",
        ) {
            prop_assume!(!prefix.starts_with('"') && !(prefix.is_empty() && (bad == b' ' || bad == b'\t')));
            let mut raw = prefix.clone().into_bytes();
            raw.push(bad);
            raw.extend_from_slice(suffix.as_bytes());
            prop_assert_eq!(
                IdempotencyKey::parse(&raw, 255),
                Err(KeyError::InvalidByte { byte: bad, offset: prefix.len() })
            );
        }
    }
}
