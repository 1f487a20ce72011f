//! Canonical JSON (spec/003 §4): object keys sorted by their UTF-8 bytes, no whitespace,
//! integers as integers, other numbers with exactly 9 decimals, strings escaped as serde_json
//! escapes them. Two equal values always serialise to the same bytes.

use serde::Serialize;
use serde_json::Value;

/// Decimal places used for non-integer numbers (`NUMERIC_PRECISION` in spec/003).
pub const NUMERIC_PRECISION: usize = 9;

/// Serialises any `Serialize` value canonically.
pub fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = serde_json::to_value(value)?;
    let mut out = Vec::with_capacity(256);
    write_value(&value, &mut out);
    Ok(out)
}

/// Canonical form as a `String` (always valid UTF-8).
pub fn to_string<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let bytes = to_vec(value)?;
    // The writer only emits UTF-8 (keys and strings come from `String`s).
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn write_value(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.extend_from_slice(i.to_string().as_bytes());
            } else if let Some(u) = n.as_u64() {
                out.extend_from_slice(u.to_string().as_bytes());
            } else {
                let f = n.as_f64().unwrap_or(0.0);
                out.extend_from_slice(format!("{f:.NUMERIC_PRECISION$}").as_bytes());
            }
        }
        Value::String(s) => write_string(s, out),
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
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(key, out);
                out.push(b':');
                write_value(&map[key], out);
            }
            out.push(b'}');
        }
    }
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    // serde_json's string escaping is already deterministic; reuse it.
    let escaped = serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\""));
    out.extend_from_slice(escaped.as_bytes());
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn keys_are_sorted_at_every_depth_and_whitespace_is_gone() {
        let v = json!({"b": 1, "a": {"z": [3, {"y": true, "x": null}], "c": "s"}});
        assert_eq!(
            to_string(&v).unwrap(),
            r#"{"a":{"c":"s","z":[3,{"x":null,"y":true}]},"b":1}"#
        );
    }

    #[test]
    fn floats_have_nine_decimals_and_integers_none() {
        let v = json!({"f": 0.5, "i": 7, "n": -3, "big": u64::MAX});
        assert_eq!(
            to_string(&v).unwrap(),
            r#"{"big":18446744073709551615,"f":0.500000000,"i":7,"n":-3}"#
        );
    }

    #[test]
    fn strings_are_escaped() {
        let v = json!({"s": "a\"b\\c\n\u{1}é"});
        assert_eq!(to_string(&v).unwrap(), "{\"s\":\"a\\\"b\\\\c\\n\\u0001é\"}");
    }

    #[test]
    fn equal_values_give_equal_bytes_whatever_the_insertion_order() {
        let a: Value = serde_json::from_str(r#"{"x":1,"y":2}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"y":2,"x":1}"#).unwrap();
        assert_eq!(to_vec(&a).unwrap(), to_vec(&b).unwrap());
    }
}
