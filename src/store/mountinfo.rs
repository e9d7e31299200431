//! Reading `/proc/self/mountinfo`, which escapes space, tab, newline and backslash in
//! paths as octal (`\040`).

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u16, |acc, d| acc * 8 + u16::from(d - b'0'));
                if let Ok(v) = u8::try_from(value) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::unescape;

    #[test]
    fn escapes_are_undone_and_odd_ones_kept() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\"), "/end\\");
        // Not a byte: left as it is, never an overflow.
        assert_eq!(unescape("/x\\777"), "/x\\777");
    }
}
