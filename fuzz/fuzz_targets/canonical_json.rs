//! Canonical JSON: any bytes. Never panics; the canonical form of a
//! document is canonical itself (idempotent), parses to the same value
//! (number text included) and is what any reordering of it yields.
#![no_main]

use idemproxy::idempotency::fingerprint::canonical_json;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Some(canonical) = canonical_json(data) else {
        assert!(serde_json::from_slice::<Value>(data).is_err());
        return;
    };
    assert_eq!(canonical_json(&canonical).as_deref(), Some(&canonical[..]));
    let original: Value = serde_json::from_slice(data).expect("it was canonicalised");
    let again: Value = serde_json::from_slice(&canonical).expect("canonical form parses");
    // With `arbitrary_precision`, numbers compare by their text.
    assert_eq!(original, again);
    // serde_json's own compact rendering, in whatever order its map keeps,
    // canonicalises to the same bytes.
    let compact = serde_json::to_vec(&original).expect("serialisable");
    assert_eq!(canonical_json(&compact).as_deref(), Some(&canonical[..]));
});
