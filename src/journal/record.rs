//! One line of a journal segment, and the segment's header.
//!
//! A record is a line of text, checked by a hash of the line so that a torn or garbled line
//! (a writer that died mid-write, a block that never reached the server) is told from a
//! record:
//!
//! ```text
//! <seq> <unix-ms> <event> <kind> <id> <check>
//! 17 1765065600123 ready image 3f1c…(64 hex) 8c2a41e07b5d9f10
//! ```
//!
//! `check` is the first 8 bytes, in hex, of the SHA-256 of everything before it (the space
//! included). A segment begins with a header line naming its publisher and generation; a
//! sealed segment ends with a `sealed` record naming the generation that follows.

use sha2::{Digest, Sha256};

use crate::layout::is_object_id;
use crate::report::Kind;

/// What happened to an object, as the publisher's readiness rules saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Event {
    /// Became ready (added, or a pull finished).
    Ready,
    /// Ready before and after, but its metadata changed (a re-tag).
    Changed,
    /// No longer ready, or gone.
    Removed,
}

impl Event {
    fn as_str(self) -> &'static str {
        match self {
            Event::Ready => "ready",
            Event::Changed => "changed",
            Event::Removed => "removed",
        }
    }

    fn parse(s: &str) -> Option<Event> {
        Some(match s {
            "ready" => Event::Ready,
            "changed" => Event::Changed,
            "removed" => Event::Removed,
            _ => return None,
        })
    }
}

/// The body of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// An object's state changed.
    Object {
        event: Event,
        kind: Kind,
        id: String,
    },
    /// The segment ends here; the publisher goes on in `next`.
    Sealed { next: u64 },
}

/// One record of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Numbered from 1 within a segment.
    pub seq: u64,
    /// When the publisher wrote it, in milliseconds since the epoch.
    pub unix_ms: u64,
    pub body: Body,
}

impl Record {
    /// The line, with its check and the newline.
    pub fn encode(&self) -> String {
        let body = match &self.body {
            Body::Object { event, kind, id } => format!("{} {kind} {id}", event.as_str()),
            Body::Sealed { next } => format!("sealed next {next:016x}"),
        };
        let line = format!("{} {} {body} ", self.seq, self.unix_ms);
        let check = check_of(line.as_bytes());
        format!("{line}{check}\n")
    }

    /// Parses one line (without its newline); `None` for anything that is not a whole,
    /// intact record.
    pub fn decode(line: &[u8]) -> Option<Record> {
        let text = std::str::from_utf8(line).ok()?;
        let (signed, check) = text.rsplit_once(' ')?;
        if check_of(format!("{signed} ").as_bytes()) != check {
            return None;
        }
        let mut fields = signed.split(' ');
        let seq = fields.next()?.parse().ok()?;
        let unix_ms = fields.next()?.parse().ok()?;
        let what = fields.next()?;
        let (a, b) = (fields.next()?, fields.next()?);
        if fields.next().is_some() {
            return None;
        }
        let body = match (what, a) {
            ("sealed", "next") => Body::Sealed {
                next: u64::from_str_radix(b, 16).ok()?,
            },
            _ => {
                let event = Event::parse(what)?;
                let kind = match a {
                    "layer" => Kind::Layer,
                    "image" => Kind::Image,
                    _ => return None,
                };
                // An id is what names a directory of the remote: nothing else may come
                // out of a journal, whatever was written into it.
                if !is_object_id(b) {
                    return None;
                }
                Body::Object {
                    event,
                    kind,
                    id: b.to_owned(),
                }
            }
        };
        Some(Record { seq, unix_ms, body })
    }
}

/// The first line of every segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub publisher: String,
    pub generation: u64,
}

const HEADER_TAG: &str = "layerfs-journal 1";

impl Header {
    pub fn encode(&self) -> String {
        format!("{HEADER_TAG} {} {:016x}\n", self.publisher, self.generation)
    }

    pub fn decode(line: &[u8]) -> Option<Header> {
        let text = std::str::from_utf8(line).ok()?;
        let rest = text.strip_prefix(HEADER_TAG)?.strip_prefix(' ')?;
        let (publisher, generation) = rest.split_once(' ')?;
        if !is_publisher_name(publisher) {
            return None;
        }
        Some(Header {
            publisher: publisher.to_owned(),
            generation: u64::from_str_radix(generation, 16).ok()?,
        })
    }
}

/// A publisher's name goes into file names and lines: letters, digits, `-` and `_`, at most
/// 64 of them.
pub fn is_publisher_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The check of a line: the first 8 bytes of the SHA-256 of `bytes`, as 16 hex digits.
pub(super) fn check_of(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let head = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    format!("{head:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f1c0d7e5b9a4c2d8e6f1a3b5c7d9e0f2a4b6c8d0e1f3a5b7c9d1e2f4a6b8c0d";

    fn object(seq: u64, event: Event, kind: Kind) -> Record {
        Record {
            seq,
            unix_ms: 1_765_065_600_123,
            body: Body::Object {
                event,
                kind,
                id: ID.to_owned(),
            },
        }
    }

    #[test]
    fn records_round_trip() {
        for record in [
            object(1, Event::Ready, Kind::Layer),
            object(2, Event::Changed, Kind::Image),
            object(3, Event::Removed, Kind::Image),
            Record {
                seq: 4,
                unix_ms: 7,
                body: Body::Sealed { next: 0x2a },
            },
        ] {
            let line = record.encode();
            assert!(line.ends_with('\n'));
            assert_eq!(Record::decode(line.trim_end().as_bytes()), Some(record));
        }
    }

    #[test]
    fn a_damaged_line_is_not_a_record() {
        let line = object(9, Event::Ready, Kind::Image).encode();
        let line = line.trim_end();
        // Every truncation (a torn write) and every single-byte change is refused.
        for cut in 0..line.len() {
            assert_eq!(
                Record::decode(&line.as_bytes()[..cut]),
                None,
                "cut at {cut}"
            );
        }
        for at in 0..line.len() {
            let mut bytes = line.as_bytes().to_vec();
            bytes[at] ^= 0x01;
            assert_eq!(Record::decode(&bytes), None, "byte {at} flipped");
        }
        assert_eq!(Record::decode(&[0; 120]), None);
    }

    #[test]
    fn only_ids_come_out() {
        let mut record = object(1, Event::Ready, Kind::Layer);
        record.body = Body::Object {
            event: Event::Ready,
            kind: Kind::Layer,
            id: "../../etc".to_owned(),
        };
        assert_eq!(Record::decode(record.encode().trim_end().as_bytes()), None);
    }

    #[test]
    fn headers_round_trip_and_names_are_checked() {
        let header = Header {
            publisher: "host-a_1".to_owned(),
            generation: 3,
        };
        assert_eq!(
            Header::decode(header.encode().trim_end().as_bytes()),
            Some(header)
        );
        assert!(Header::decode(b"layerfs-journal 1 a/b 0000000000000001").is_none());
        assert!(Header::decode(b"layerfs-journal 2 a 0000000000000001").is_none());
        assert!(!is_publisher_name(""));
        assert!(!is_publisher_name(&"a".repeat(65)));
        assert!(is_publisher_name("node-17"));
    }
}
