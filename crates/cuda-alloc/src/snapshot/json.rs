//! [`PyValue`] to and from JSON, for snapshot files read by tools without Python.
//!
//! JSON has fewer types than Python: tuples, sets and frozensets become arrays, bytes become arrays of
//! numbers, dict keys that are not strings are written as their Python rendering, and NaN or infinite
//! floats become `null`. Reading JSON back gives lists for arrays; the typed snapshot model knows which
//! fields are tuples, so a snapshot survives the trip through JSON except for such values in unknown keys.

use serde_json::{Map, Number, Value};

use super::pyvalue::PyValue;

/// `value` as JSON.
pub(crate) fn to_json(value: &PyValue) -> Value {
    match value {
        PyValue::None => Value::Null,
        PyValue::Bool(b) => Value::Bool(*b),
        PyValue::Int(i) => int_to_json(*i),
        PyValue::Float(x) => Number::from_f64(*x).map_or(Value::Null, Value::Number),
        PyValue::Str(s) => Value::String(s.clone()),
        PyValue::Bytes(b) => Value::Array(b.iter().map(|&byte| Value::from(byte)).collect()),
        PyValue::List(items)
        | PyValue::Tuple(items)
        | PyValue::Set(items)
        | PyValue::FrozenSet(items) => Value::Array(items.iter().map(to_json).collect()),
        PyValue::Dict(items) => {
            let mut map = Map::with_capacity(items.len());
            for (key, value) in items {
                let key = match key {
                    PyValue::Str(s) => s.clone(),
                    other => other.to_string(),
                };
                map.insert(key, to_json(value));
            }
            Value::Object(map)
        }
    }
}

fn int_to_json(i: i128) -> Value {
    if let Ok(small) = i64::try_from(i) {
        Value::from(small)
    } else if let Ok(unsigned) = u64::try_from(i) {
        Value::from(unsigned)
    } else {
        // Beyond what JSON numbers carry exactly: keep the digits.
        Value::String(i.to_string())
    }
}

/// JSON as a [`PyValue`].
pub(crate) fn from_json(value: &Value) -> PyValue {
    match value {
        Value::Null => PyValue::None,
        Value::Bool(b) => PyValue::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => PyValue::Int(i.into()),
            (_, Some(u)) => PyValue::Int(u.into()),
            _ => PyValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => PyValue::Str(s.clone()),
        Value::Array(items) => PyValue::List(items.iter().map(from_json).collect()),
        Value::Object(map) => PyValue::Dict(
            map.iter()
                .map(|(k, v)| (PyValue::Str(k.clone()), from_json(v)))
                .collect(),
        ),
    }
}
