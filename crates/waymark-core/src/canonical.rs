use serde_json::Value;

/// Writes `value` as canonical JSON: object keys sorted by their UTF-8 bytes, no whitespace,
/// strings escaped as serde_json escapes them.
///
/// Sorting here (rather than trusting the map type) keeps the output stable even when a
/// dependency turns on serde_json's `preserve_order` feature.
pub fn canonical_json(value: &Value) -> String {
    let mut out = Vec::with_capacity(256);
    write_value(value, &mut out);
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// Writes `value` into `out`: strings and numbers as serde_json writes them (compact, the
/// same bytes as `Value::to_string`), object keys in byte order. Nothing is allocated per
/// value: the audit chain hashes every event through this, and `audit verify` every stored one.
fn write_value(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            out.push(b'{');
            let mut first = true;
            let mut field = |key: &String, v: &Value, out: &mut Vec<u8>| {
                if !std::mem::take(&mut first) {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key).expect("writing to a Vec");
                out.push(b':');
                write_value(v, out);
            };
            // serde_json's map is ordered by key unless a crate in the build turns on
            // `preserve_order`; then sort.
            if map.keys().is_sorted() {
                for (k, v) in map {
                    field(k, v, out);
                }
            } else {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                for k in keys {
                    field(k, &map[k.as_str()], out);
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out);
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing to a Vec"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sorted_at_every_depth_and_whitespace_dropped() {
        let a: Value =
            serde_json::from_str(r#"{ "b": 1, "a": {"y": [1, {"d":2,"c":3}], "x": "s"} }"#)
                .unwrap();
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"x":"s","y":[1,{"c":3,"d":2}]},"b":1}"#
        );
    }

    /// The writer before it stopped allocating per value: every chain and fingerprint made
    /// with it must hash the same bytes.
    fn reference(value: &Value, out: &mut String) {
        match value {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, key) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(key.clone()).to_string());
                    out.push(':');
                    reference(&map[key.as_str()], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    reference(item, out);
                }
                out.push(']');
            }
            scalar => out.push_str(&scalar.to_string()),
        }
    }

    #[test]
    fn the_bytes_are_those_of_the_writer_every_stored_chain_was_made_with() {
        let v = serde_json::json!({
            "z": [null, true, false, 0, -1, u64::MAX, i64::MIN, 1.5, -2.25e-7, 1e300],
            "é": "ünï\u{0}\u{1f}\u{7f}\u{2028}\"\\/\t🦀",
            "A": {"b": {}, "a": [], "": ""},
            "\u{1}ctl": {"nested": [{"y": 1, "x": [2, {"k": "v"}]}]},
        });
        let mut expected = String::new();
        reference(&v, &mut expected);
        assert_eq!(canonical_json(&v), expected);
    }

    #[test]
    fn strings_are_escaped() {
        let v = serde_json::json!({"k\"": "line\nbreak"});
        assert_eq!(canonical_json(&v), r#"{"k\"":"line\nbreak"}"#);
    }
}
