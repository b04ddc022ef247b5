//! `Idempotency-Key` header values: any bytes, any limit. Parsing never
//! panics, and an accepted key is 1..=limit bytes of visible ASCII that
//! parses to itself again.
#![no_main]

use idemproxy::idempotency::IdempotencyKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&limit, raw)) = data.split_first() else {
        return;
    };
    let max = usize::from(limit).max(1) * 4;
    if let Ok(key) = IdempotencyKey::parse(raw, max) {
        let text = key.as_str();
        assert!(!text.is_empty() && text.len() <= max, "{key:?}");
        assert!(text.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{key:?}");
        // The bare form of an accepted key names the same key (unless it
        // starts with a quote, which selects the structured-field form).
        if !text.starts_with('"') {
            assert_eq!(
                IdempotencyKey::parse(text.as_bytes(), max).as_ref(),
                Ok(&key)
            );
        }
    }
});
