//! Numbers in a configuration string, read as PyTorch reads them: with C++'s `std::stoull` (every
//! whole-number key) and `std::stod` (every decimal key). Both read the longest prefix of the text
//! that is a number and ignore the rest (`64abc` is 64, `1.5` is 1 to `stoull`, `0.5x` is 0.5), and
//! `stoull` takes a sign, wrapping a negative number around (`-1` is 2^64 - 1, which PyTorch then
//! caps: `max_split_size_mb:-1` means unlimited). They refuse text that does not start with a
//! number, and numbers out of their type's range.

/// Why a value is not a number to C++.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NumberError {
    /// The text does not start with a number (`std::invalid_argument`).
    NoNumber,
    /// The number is out of the type's range (`std::out_of_range`).
    OutOfRange,
}

/// A number read from the start of a text.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Prefix<T> {
    /// The number.
    pub(super) value: T,
    /// How many bytes of the text it took; less than the text's length when C++ ignored a tail.
    pub(super) len: usize,
    /// Whether a minus sign wrapped a whole number around.
    pub(super) wrapped: bool,
}

/// C's `isspace` in the "C" locale, which `strtoull` and `strtod` skip at the start.
pub(super) fn is_c_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\x0B' | b'\x0C' | b'\r')
}

/// The text's leading C whitespace and sign: (bytes taken, negative).
fn sign(bytes: &[u8]) -> (usize, bool) {
    let mut at = bytes.iter().take_while(|b| is_c_space(**b)).count();
    let negative = bytes.get(at) == Some(&b'-');
    if matches!(bytes.get(at), Some(b'+' | b'-')) {
        at += 1;
    }
    (at, negative)
}

fn digits(bytes: &[u8], radix: u32) -> usize {
    bytes
        .iter()
        .take_while(|b| char::from(**b).is_digit(radix))
        .count()
}

/// `std::stoull(text)`, base 10.
pub(super) fn stoull(text: &str) -> Result<Prefix<u64>, NumberError> {
    let bytes = text.as_bytes();
    let (start, negative) = sign(bytes);
    let count = digits(&bytes[start..], 10);
    if count == 0 {
        return Err(NumberError::NoNumber);
    }
    let end = start + count;
    let magnitude = text[start..end]
        .parse::<u64>()
        .map_err(|_| NumberError::OutOfRange)?;
    let wrapped = negative && magnitude != 0;
    Ok(Prefix {
        value: if negative {
            magnitude.wrapping_neg()
        } else {
            magnitude
        },
        len: end,
        wrapped,
    })
}

/// `std::stod(text)`: decimal and hexadecimal numbers, `inf`, `infinity` and `nan` (any case).
/// Results that overflow, or underflow to zero or below the smallest normal double, are out of
/// range (glibc's `strtod` sets `ERANGE` for them and `stod` throws).
pub(super) fn stod(text: &str) -> Result<Prefix<f64>, NumberError> {
    let bytes = text.as_bytes();
    let (start, negative) = sign(bytes);
    let body = &bytes[start..];
    let signed = |magnitude: f64| if negative { -magnitude } else { magnitude };
    let lower: Vec<u8> = body.iter().take(8).map(u8::to_ascii_lowercase).collect();
    if lower.starts_with(b"inf") {
        let len = if lower.starts_with(b"infinity") { 8 } else { 3 };
        return Ok(float(signed(f64::INFINITY), start + len));
    }
    if lower.starts_with(b"nan") {
        let mut len = 3;
        // `nan(chars)`: letters, digits and underscores in parentheses.
        if body.get(3) == Some(&b'(') {
            let inner = body[4..]
                .iter()
                .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
                .count();
            if body.get(4 + inner) == Some(&b')') {
                len = 5 + inner;
            }
        }
        return Ok(float(f64::NAN, start + len));
    }
    let hex = lower.starts_with(b"0x")
        && body.get(2).is_some_and(|b| {
            b.is_ascii_hexdigit() || (*b == b'.' && body.get(3).is_some_and(u8::is_ascii_hexdigit))
        });
    let (magnitude, len, nonzero) = if hex {
        let (value, len, nonzero) = hexadecimal(&body[2..]);
        (value, len + 2, nonzero)
    } else {
        decimal(text, start)?
    };
    let value = signed(magnitude);
    let underflow = nonzero && (magnitude == 0.0 || magnitude < f64::MIN_POSITIVE);
    if magnitude.is_infinite() || underflow {
        return Err(NumberError::OutOfRange);
    }
    Ok(float(value, start + len))
}

fn float(value: f64, len: usize) -> Prefix<f64> {
    Prefix {
        value,
        len,
        wrapped: false,
    }
}

/// The length of an exponent (`e-3`, `p+4`) at the start of `bytes` after its letter, or 0 when
/// the letter is not followed by an optional sign and a digit (then it is not part of the number).
fn exponent_len(bytes: &[u8]) -> usize {
    let sign = usize::from(matches!(bytes.first(), Some(b'+' | b'-')));
    match digits(&bytes[sign..], 10) {
        0 => 0,
        count => sign + count,
    }
}

/// A decimal number at `text[start..]`: (magnitude, length, whether any digit was non-zero).
fn decimal(text: &str, start: usize) -> Result<(f64, usize, bool), NumberError> {
    let bytes = &text.as_bytes()[start..];
    let whole = digits(bytes, 10);
    let mut len = whole;
    let mut fraction = 0;
    if bytes.get(len) == Some(&b'.') {
        fraction = digits(&bytes[len + 1..], 10);
        len += 1 + fraction;
    }
    if whole + fraction == 0 {
        return Err(NumberError::NoNumber);
    }
    let nonzero = bytes[..len].iter().any(|b| matches!(b, b'1'..=b'9'));
    if matches!(bytes.get(len), Some(b'e' | b'E')) {
        let exponent = exponent_len(&bytes[len + 1..]);
        if exponent > 0 {
            len += 1 + exponent;
        }
    }
    // Rust's float grammar takes every such prefix (`5.`, `.5`, `1e-3`), rounding as strtod does.
    let value = text[start..start + len]
        .parse::<f64>()
        .map_err(|_| NumberError::NoNumber)?;
    Ok((value, len, nonzero))
}

/// A hexadecimal number after its `0x`: (magnitude, length, whether any digit was non-zero).
fn hexadecimal(bytes: &[u8]) -> (f64, usize, bool) {
    let mut mantissa: u64 = 0;
    let mut exponent: i64 = 0;
    let mut nonzero = false;
    let mut len = 0;
    let mut seen_point = false;
    while let Some(&byte) = bytes.get(len) {
        if byte == b'.' && !seen_point {
            seen_point = true;
        } else if let Some(digit) = char::from(byte).to_digit(16) {
            nonzero |= digit != 0;
            if mantissa >> 60 == 0 {
                mantissa = mantissa * 16 + u64::from(digit);
                if seen_point {
                    exponent -= 4;
                }
            } else if !seen_point {
                // Digits beyond what the mantissa holds only scale it.
                exponent += 4;
            }
        } else {
            break;
        }
        len += 1;
    }
    if matches!(bytes.get(len), Some(b'p' | b'P')) {
        let exponent_text = exponent_len(&bytes[len + 1..]);
        if exponent_text > 0 {
            let text = std::str::from_utf8(&bytes[len + 1..len + 1 + exponent_text])
                .expect("sign and ASCII digits");
            exponent =
                exponent.saturating_add(text.parse::<i64>().unwrap_or(if text.starts_with('-') {
                    i64::MIN / 2
                } else {
                    i64::MAX / 2
                }));
            len += 1 + exponent_text;
        }
    }
    let scale = i32::try_from(exponent.clamp(-2000, 2000)).expect("clamped");
    (mantissa as f64 * 2f64.powi(scale), len, nonzero)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ull(text: &str) -> Result<(u64, usize), NumberError> {
        stoull(text).map(|p| (p.value, p.len))
    }

    fn dbl(text: &str) -> Result<(f64, usize), NumberError> {
        stod(text).map(|p| (p.value, p.len))
    }

    #[test]
    fn whole_numbers_read_as_stoull_reads_them() {
        assert_eq!(ull("64"), Ok((64, 2)));
        assert_eq!(ull("00064"), Ok((64, 5)));
        assert_eq!(ull("+64"), Ok((64, 3)));
        assert_eq!(ull("64abc"), Ok((64, 2)));
        assert_eq!(ull("64.9"), Ok((64, 2)));
        assert_eq!(ull("1e3"), Ok((1, 1)));
        assert_eq!(ull("0x20"), Ok((0, 1)));
        assert_eq!(ull("-1"), Ok((u64::MAX, 2)));
        assert!(stoull("-1").unwrap().wrapped);
        assert!(!stoull("-0").unwrap().wrapped);
        assert_eq!(ull("-0"), Ok((0, 2)));
        assert_eq!(ull("-18446744073709551615"), Ok((1, 21)));
        assert_eq!(ull("18446744073709551615"), Ok((u64::MAX, 20)));
        assert_eq!(ull("18446744073709551616"), Err(NumberError::OutOfRange));
        assert_eq!(ull("\t 7"), Ok((7, 3)));
        for text in ["", "abc", "-", "+", "x1", "[1:4]", ".5", " "] {
            assert_eq!(ull(text), Err(NumberError::NoNumber), "{text:?}");
        }
    }

    #[test]
    fn decimals_read_as_stod_reads_them() {
        assert_eq!(dbl("0.5"), Ok((0.5, 3)));
        assert_eq!(dbl(".5"), Ok((0.5, 2)));
        assert_eq!(dbl("5."), Ok((5.0, 2)));
        assert_eq!(dbl("5e-1"), Ok((0.5, 4)));
        assert_eq!(dbl("0.5x"), Ok((0.5, 3)));
        assert_eq!(dbl("1e"), Ok((1.0, 1)));
        assert_eq!(dbl("1e+"), Ok((1.0, 1)));
        assert_eq!(dbl("-0.0"), Ok((-0.0, 4)));
        assert_eq!(dbl("0x1p-1"), Ok((0.5, 6)));
        assert_eq!(dbl("0x.8"), Ok((0.5, 4)));
        assert_eq!(dbl("0x1.8p1"), Ok((3.0, 7)));
        assert_eq!(dbl("0x"), Ok((0.0, 1)));
        assert_eq!(dbl("0xg"), Ok((0.0, 1)));
        assert_eq!(dbl("inf"), Ok((f64::INFINITY, 3)));
        assert_eq!(dbl("-Infinity"), Ok((f64::NEG_INFINITY, 9)));
        assert!(dbl("nan").unwrap().0.is_nan());
        assert_eq!(stod("NaN(123)").unwrap().len, 8);
        assert_eq!(stod("nan(").unwrap().len, 3);
        assert_eq!(dbl("1e999"), Err(NumberError::OutOfRange));
        assert_eq!(dbl("1e-400"), Err(NumberError::OutOfRange));
        assert_eq!(dbl("1e-310"), Err(NumberError::OutOfRange));
        assert_eq!(dbl("0e-400"), Ok((0.0, 6)));
        for text in ["", "abc", ".", "-", "e5", "x", "-.e1"] {
            assert_eq!(dbl(text), Err(NumberError::NoNumber), "{text:?}");
        }
    }
}
