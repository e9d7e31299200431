//! SHA-512, the BackingImage checksum.
//!
//! Hashing bounds how fast an image is downloaded, exported or verified, and SHA-512 cannot
//! be split across cores. ring's assembly hashes about 1.35× as fast as the `sha2` crate on
//! CPUs without SHA-512 instructions (`benches/README.md`), and ring is already linked for TLS.
//! The tests check it against `sha2`, an independent implementation.

use ring::digest::{Context, SHA512};

/// A running SHA-512.
pub struct Sha512(Context);

impl Sha512 {
    pub fn new() -> Sha512 {
        Sha512(Context::new(&SHA512))
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The digest as 128 lower-case hex digits, the form images and handles carry.
    pub fn finish_hex(self) -> String {
        hex(self.0.finish().as_ref())
    }
}

impl Default for Sha512 {
    fn default() -> Sha512 {
        Sha512::new()
    }
}

/// The SHA-512 of `bytes`.
pub fn digest(bytes: &[u8]) -> [u8; 64] {
    let mut out = [0u8; 64];
    out.copy_from_slice(ring::digest::digest(&SHA512, bytes).as_ref());
    out
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest;

    #[test]
    fn agrees_with_an_independent_implementation_across_update_boundaries() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for split in [0, 1, 127, 128, 129, 65_536, 299_999] {
            let mut sha = Sha512::new();
            sha.update(&data[..split]);
            sha.update(&data[split..]);
            assert_eq!(
                sha.finish_hex(),
                hex(&sha2::Sha512::digest(&data)),
                "split {split}"
            );
        }
        assert_eq!(digest(b"abc")[..], sha2::Sha512::digest(b"abc")[..]);
        assert_eq!(Sha512::new().finish_hex(), hex(&sha2::Sha512::digest(b"")));
    }
}
