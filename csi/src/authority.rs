//! Any `:authority` a gRPC client sends over the unix socket is accepted.
//!
//! The HTTP/2 layer under tonic (h2) resets a stream whose `:authority` is not a URI
//! authority, before any driver code runs. Over a unix socket the authority means nothing,
//! yet clients fill it in their own ways: Go's sends `localhost`, grpc-core (Python, C++,
//! Ruby, grpcurl's C builds) sends the socket path, which has slashes. So every connection
//! passes through [`shim`], which rewrites the client's header blocks on their way to h2:
//! an `:authority` that is not a valid authority becomes `localhost`; everything else is
//! left as it was.
//!
//! Rewriting a header block means decoding it (HPACK keeps a table across a connection's
//! blocks, so every block is decoded, in order) and encoding it again. The blocks given to
//! h2 use only literals without indexing, so h2's table stays empty and can never disagree
//! with the client's. Frames other than HEADERS and CONTINUATION, and everything the server
//! sends, pass through unchanged. The driver's traffic is control-plane only: the extra copy
//! costs nothing measurable.

use std::borrow::Cow;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

/// What a client sends first on an HTTP/2 connection (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
/// The largest frame the server accepts: the size every peer must accept (RFC 9113 §4.2),
/// which the server announces (`server::serve`). A client's larger frame is a connection
/// error (§4.2), so the shim refuses it on its header rather than buffer its payload.
pub const MAX_FRAME: usize = 16_384;
/// A header block larger than this is refused (h2 refuses far smaller ones itself).
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What a decoded header list may add up to, counted as RFC 7541 §4.1 counts table entries.
/// References into the table let a small block decode to thousands of times its size; h2
/// refuses lists far smaller than this, so only garbage meets the limit.
const MAX_HEADER_LIST: usize = 1 << 20;
/// The per-field overhead of RFC 7541 §4.1.
const ENTRY_OVERHEAD: usize = 32;
/// The largest HPACK dynamic table a client may ask the shim to keep. The server never sends
/// SETTINGS_HEADER_TABLE_SIZE, so the client is held to HTTP/2's initial value (RFC 9113
/// §6.5.2); a size update above it is a decoding error (RFC 7541 §4.2, §6.3).
const TABLE_SIZE: usize = 4096;
/// What an authority that h2 would refuse becomes.
const LOCAL: &[u8] = b"localhost";

/// A header field as decoded: name and value octets.
type Field = (Vec<u8>, Vec<u8>);

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Why a connection was dropped by the shim; h2 would have dropped it for the same reasons.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not an HTTP/2 connection (bad preface)")]
    Preface,
    #[error("malformed frame: {0}")]
    Frame(&'static str),
    #[error("header block does not decode: {0}")]
    Hpack(String),
    #[error("{0} larger than {1} bytes")]
    TooLarge(&'static str, usize),
}

/// Serves `client` through the rewriting shim: returns the stream to hand to the gRPC server,
/// and spawns the task that pumps both directions until either side closes.
pub fn shim<S>(client: S) -> DuplexStream
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (server_side, ours) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let (mut from_client, mut to_client) = tokio::io::split(client);
        let (mut from_server, mut to_server) = tokio::io::split(ours);
        let inbound = async {
            let result = rewrite(&mut from_client, &mut to_server).await;
            let _ = to_server.shutdown().await;
            result
        };
        let outbound = async {
            let result = tokio::io::copy(&mut from_server, &mut to_client).await;
            let _ = to_client.shutdown().await;
            result
        };
        let (inbound, _) = tokio::join!(inbound, outbound);
        if let Err(e) = inbound {
            tracing::debug!(error = %e, "gRPC connection dropped");
        }
    });
    server_side
}

/// Copies the client's side of a connection from `from` to `to`, rewriting header blocks.
pub async fn rewrite<R, W>(from: &mut R, to: &mut W) -> Result<(), ShimError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE.len()];
    match from.read_exact(&mut preface).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    if preface != PREFACE {
        return Err(ShimError::Preface);
    }
    to.write_all(&preface).await?;
    let mut blocks = Blocks::default();
    let mut payload = Vec::new();
    loop {
        let mut header = [0u8; FRAME_HEADER];
        match from.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        if len > MAX_FRAME {
            return Err(ShimError::Frame("frame larger than the server allows"));
        }
        payload.resize(len, 0);
        from.read_exact(&mut payload).await?;
        let frame = Frame {
            kind: header[3],
            flags: header[4],
            stream: u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff,
            payload: &payload,
        };
        match blocks.take(frame)? {
            Taken::Pass => {
                to.write_all(&header).await?;
                to.write_all(&payload).await?;
            }
            Taken::Pending => {}
            Taken::Ready(frames) => to.write_all(&frames).await?,
        }
        to.flush().await?;
    }
}

struct Frame<'a> {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: &'a [u8],
}

enum Taken {
    /// Not a header frame: forward it as it came.
    Pass,
    /// Part of a header block whose end has not arrived.
    Pending,
    /// A whole header block, rewritten, as the frames to forward.
    Ready(Vec<u8>),
}

/// The state of the client's header blocks: HPACK's table, and a block being collected.
struct Blocks {
    decoder: loona_hpack::Decoder<'static>,
    open: Option<OpenBlock>,
}

impl Default for Blocks {
    fn default() -> Blocks {
        // The table starts at TABLE_SIZE and evicts oldest-first as entries arrive
        // (RFC 7541 §4.4); capping size updates keeps it there.
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Blocks {
            decoder,
            open: None,
        }
    }
}

struct OpenBlock {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

impl Blocks {
    fn take(&mut self, frame: Frame<'_>) -> Result<Taken, ShimError> {
        if let Some(open) = &mut self.open {
            // A header block's frames are contiguous (RFC 9113 §6.10).
            if frame.kind != CONTINUATION || frame.stream != open.stream {
                return Err(ShimError::Frame("header block interrupted"));
            }
            within_block_limit(open.fragment.len() + frame.payload.len())?;
            open.fragment.extend_from_slice(frame.payload);
        } else {
            match frame.kind {
                HEADERS => self.open = Some(OpenBlock::start(&frame)?),
                CONTINUATION => return Err(ShimError::Frame("CONTINUATION without HEADERS")),
                _ => return Ok(Taken::Pass),
            }
        }
        if frame.flags & END_HEADERS == 0 {
            return Ok(Taken::Pending);
        }
        let block = self.open.take().expect("a block is open");
        let fields = self.decode(&block.fragment)?;
        Ok(Taken::Ready(block.frames(&encode(&fields))))
    }

    fn decode(&mut self, fragment: &[u8]) -> Result<Vec<Field>, ShimError> {
        let mut fields = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(fragment, |name: Cow<[u8]>, value: Cow<[u8]>| {
                // The decoder cannot be stopped from here: past the limit, fields are
                // only counted, and the block is refused once decoding ends.
                size = size.saturating_add(name.len() + value.len() + ENTRY_OVERHEAD);
                if size > MAX_HEADER_LIST {
                    return;
                }
                let value = if &*name == b":authority" && !is_authority(&value) {
                    LOCAL.to_vec()
                } else {
                    value.into_owned()
                };
                fields.push((name.into_owned(), value));
            })
            .map_err(|e| ShimError::Hpack(e.to_string()))?;
        if size > MAX_HEADER_LIST {
            return Err(ShimError::TooLarge("decoded header list", MAX_HEADER_LIST));
        }
        Ok(fields)
    }
}

impl OpenBlock {
    fn start(frame: &Frame<'_>) -> Result<OpenBlock, ShimError> {
        let mut rest = frame.payload;
        let mut padding = 0;
        if frame.flags & PADDED != 0 {
            let (&pad, tail) = rest
                .split_first()
                .ok_or(ShimError::Frame("short HEADERS"))?;
            padding = usize::from(pad);
            rest = tail;
        }
        let mut priority = None;
        if frame.flags & PRIORITY != 0 {
            if rest.len() < 5 {
                return Err(ShimError::Frame("short HEADERS"));
            }
            priority = Some(rest[..5].try_into().expect("five bytes"));
            rest = &rest[5..];
        }
        if padding > rest.len() {
            return Err(ShimError::Frame("padding longer than the frame"));
        }
        within_block_limit(rest.len() - padding)?;
        Ok(OpenBlock {
            stream: frame.stream,
            end_stream: frame.flags & END_STREAM != 0,
            priority,
            fragment: rest[..rest.len() - padding].to_vec(),
        })
    }

    /// The block as one HEADERS frame and as many CONTINUATIONs as its size needs.
    fn frames(&self, block: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(block.len() + 2 * FRAME_HEADER + 5);
        let room = MAX_FRAME - self.priority.map_or(0, |p| p.len());
        let (first, mut rest) = block.split_at(block.len().min(room));
        let mut flags = if self.end_stream { END_STREAM } else { 0 };
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        let priority = self.priority.as_ref().map_or(&[][..], |p| &p[..]);
        if !priority.is_empty() {
            flags |= PRIORITY;
        }
        push_frame(&mut out, HEADERS, flags, self.stream, &[priority, first]);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
            let flags = if tail.is_empty() { END_HEADERS } else { 0 };
            push_frame(&mut out, CONTINUATION, flags, self.stream, &[chunk]);
            rest = tail;
        }
        out
    }
}

/// A header block is held whole until it ends, so its size is bounded from its first frame.
fn within_block_limit(len: usize) -> Result<(), ShimError> {
    if len > MAX_HEADER_BLOCK {
        return Err(ShimError::TooLarge("header block", MAX_HEADER_BLOCK));
    }
    Ok(())
}

fn push_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// Whether h2 accepts `value` as an `:authority`.
fn is_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// A header block of literals without indexing and with literal names (RFC 7541 §6.2.2),
/// none Huffman-coded: the receiver's table is never touched.
fn encode(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x00);
        push_string(&mut out, name);
        push_string(&mut out, value);
    }
    out
}

/// A string literal: its length as an HPACK integer with a 7-bit prefix, then its octets.
fn push_string(out: &mut Vec<u8>, s: &[u8]) {
    push_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// An HPACK integer (RFC 7541 §5.1) in the low `prefix` bits of a first octet whose high
/// bits are `flags`.
fn push_int(out: &mut Vec<u8>, flags: u8, prefix: u32, mut n: usize) {
    let max = (1usize << prefix) - 1;
    if n < max {
        out.push(flags | n as u8);
        return;
    }
    out.push(flags | max as u8);
    n -= max;
    while n >= 0x80 {
        out.push((n & 0x7f) as u8 | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(blocks: &[Vec<u8>]) -> Vec<Vec<(String, String)>> {
        let mut decoder = loona_hpack::Decoder::new();
        blocks
            .iter()
            .map(|b| {
                decoder
                    .decode(b)
                    .unwrap()
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn long_strings_round_trip_through_a_real_decoder() {
        let long = vec![b'a'; 300];
        let fields = vec![
            (b"x-short".to_vec(), b"v".to_vec()),
            (b"x-edge".to_vec(), vec![b'b'; 0x7f]),
            (b"x-long".to_vec(), long.clone()),
        ];
        let decoded = decode_all(&[encode(&fields)]);
        assert_eq!(decoded[0][1].1.len(), 0x7f);
        assert_eq!(decoded[0][2].1.as_bytes(), &long[..]);
    }

    #[test]
    fn a_path_authority_becomes_localhost_and_the_table_stays_in_step() {
        // The client indexes its authority and refers to it in the next block.
        let mut encoder = loona_hpack::Encoder::new();
        let first: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":authority", b"/run/layerfs/csi.sock"),
            (b"x-kept", b"one"),
        ];
        let second: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":authority", b"/run/layerfs/csi.sock"),
            (b"x-kept", b"two"),
        ];
        let blocks = [encoder.encode(first), encoder.encode(second)];
        let mut state = Blocks::default();
        let mut rewritten = Vec::new();
        for (i, block) in blocks.iter().enumerate() {
            let frame = Frame {
                kind: HEADERS,
                flags: END_HEADERS,
                stream: 1 + 2 * i as u32,
                payload: block,
            };
            let Taken::Ready(frames) = state.take(frame).unwrap() else {
                panic!("a whole block is ready");
            };
            rewritten.push(frames[FRAME_HEADER..].to_vec());
        }
        for fields in decode_all(&rewritten) {
            assert!(fields.contains(&(":authority".into(), "localhost".into())));
        }
        assert!(decode_all(&rewritten)[1].contains(&("x-kept".into(), "two".into())));
    }

    #[test]
    fn a_valid_authority_is_kept() {
        let mut state = Blocks::default();
        let block = encode(&[(b":authority".to_vec(), b"csi.example:8080".to_vec())]);
        let frame = Frame {
            kind: HEADERS,
            flags: END_HEADERS,
            stream: 1,
            payload: &block,
        };
        let Taken::Ready(frames) = state.take(frame).unwrap() else {
            panic!("ready");
        };
        let fields = &decode_all(&[frames[FRAME_HEADER..].to_vec()])[0];
        assert_eq!(fields[0].1, "csi.example:8080");
    }

    #[test]
    fn big_blocks_are_split_into_continuations_and_padding_is_dropped() {
        let mut state = Blocks::default();
        let fields = vec![(b"x-big".to_vec(), vec![b'z'; 40_000])];
        let block = encode(&fields);
        // Sent padded, with a priority, in two frames.
        let mut first = vec![3u8];
        first.extend_from_slice(&[0, 0, 0, 0, 16]);
        first.extend_from_slice(&block[..100]);
        first.extend_from_slice(&[0, 0, 0]);
        let taken = state
            .take(Frame {
                kind: HEADERS,
                flags: PADDED | PRIORITY | END_STREAM,
                stream: 5,
                payload: &first,
            })
            .unwrap();
        assert!(matches!(taken, Taken::Pending));
        let Taken::Ready(out) = state
            .take(Frame {
                kind: CONTINUATION,
                flags: END_HEADERS,
                stream: 5,
                payload: &block[100..],
            })
            .unwrap()
        else {
            panic!("ready");
        };
        // Walk the frames: HEADERS (END_STREAM, PRIORITY), then CONTINUATIONs, the last
        // with END_HEADERS; each within the frame size every peer accepts.
        let mut at = 0;
        let mut joined = Vec::new();
        let mut kinds = Vec::new();
        while at < out.len() {
            let len = usize::from(out[at]) << 16
                | usize::from(out[at + 1]) << 8
                | usize::from(out[at + 2]);
            assert!(len <= MAX_FRAME);
            let (kind, flags) = (out[at + 3], out[at + 4]);
            let mut payload = &out[at + FRAME_HEADER..at + FRAME_HEADER + len];
            if kind == HEADERS {
                assert_eq!(flags & (END_STREAM | PRIORITY), END_STREAM | PRIORITY);
                payload = &payload[5..];
            }
            kinds.push((kind, flags & END_HEADERS != 0));
            joined.extend_from_slice(payload);
            at += FRAME_HEADER + len;
        }
        assert_eq!(kinds.first(), Some(&(HEADERS, false)));
        assert_eq!(kinds.last(), Some(&(CONTINUATION, true)));
        assert_eq!(decode_all(&[joined])[0][0].1.len(), 40_000);
    }

    #[test]
    fn an_interrupted_block_is_refused() {
        let mut state = Blocks::default();
        let block = encode(&[(b"a".to_vec(), b"b".to_vec())]);
        let frame = |kind, flags, stream| Frame {
            kind,
            flags,
            stream,
            payload: &block,
        };
        assert!(matches!(
            state.take(frame(HEADERS, 0, 1)),
            Ok(Taken::Pending)
        ));
        assert!(state.take(frame(0x0, 0, 1)).is_err());
        let mut state = Blocks::default();
        assert!(state.take(frame(CONTINUATION, END_HEADERS, 1)).is_err());
    }

    /// A field the receiver adds to its table (RFC 7541 §6.2.1), with a literal name.
    fn indexed_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
        out.push(0x40);
        push_string(out, name);
        push_string(out, value);
    }

    fn whole_block(state: &mut Blocks, stream: u32, block: &[u8]) -> Result<Taken, ShimError> {
        state.take(Frame {
            kind: HEADERS,
            flags: END_HEADERS,
            stream,
            payload: block,
        })
    }

    fn describe(taken: &Result<Taken, ShimError>) -> String {
        match taken {
            Ok(Taken::Pass) => "passed".into(),
            Ok(Taken::Pending) => "held as pending".into(),
            Ok(Taken::Ready(frames)) => format!("accepted ({} bytes out)", frames.len()),
            Err(e) => format!("refused: {e}"),
        }
    }

    #[test]
    fn a_table_size_update_above_the_http2_default_is_refused() {
        // Raise the table to 128 MiB, then fill it across blocks: each entry would stay.
        let mut state = Blocks::default();
        let mut block = Vec::new();
        push_int(&mut block, 0x20, 5, 1 << 27);
        indexed_literal(&mut block, b"x-fill", &[b'f'; 3000]);
        let taken = whole_block(&mut state, 1, &block);
        assert!(
            matches!(taken, Err(ShimError::Hpack(_))),
            "a table size update to 2^27 must be refused, but it was {}",
            describe(&taken)
        );
    }

    #[test]
    fn a_table_size_update_within_the_default_is_kept() {
        let mut state = Blocks::default();
        let mut block = Vec::new();
        push_int(&mut block, 0x20, 5, TABLE_SIZE);
        indexed_literal(&mut block, b"a", b"b");
        assert!(matches!(
            whole_block(&mut state, 1, &block),
            Ok(Taken::Ready(_))
        ));
    }

    #[test]
    fn the_table_evicts_its_oldest_entries_at_the_cap() {
        // Three entries of 2033 bytes each (RFC 7541 §4.1) do not fit in 4096: the first goes.
        let mut state = Blocks::default();
        for (i, fill) in [b'1', b'2', b'3'].into_iter().enumerate() {
            let mut block = Vec::new();
            indexed_literal(&mut block, b"x", &[fill; 2000]);
            whole_block(&mut state, 1 + 2 * i as u32, &block).unwrap();
        }
        // The dynamic table starts at index 62 with its newest entry.
        let Taken::Ready(frames) = whole_block(&mut state, 7, &[0x80 | 63]).unwrap() else {
            panic!("ready");
        };
        let fields = &decode_all(&[frames[FRAME_HEADER..].to_vec()])[0];
        assert_eq!(fields[0].1.as_bytes(), &[b'2'; 2000][..]);
        let taken = whole_block(&mut state, 9, &[0x80 | 64]);
        assert!(
            matches!(taken, Err(ShimError::Hpack(_))),
            "the evicted entry must be gone, but it was {}",
            describe(&taken)
        );
    }

    #[test]
    fn a_first_headers_frame_over_the_block_limit_is_refused() {
        let block = encode(&[(b"x-big".to_vec(), vec![b'z'; MAX_HEADER_BLOCK])]);
        assert!(block.len() > MAX_HEADER_BLOCK);
        let taken = whole_block(&mut Blocks::default(), 1, &block);
        assert!(
            matches!(taken, Err(ShimError::TooLarge(..))),
            "a single HEADERS frame of {} bytes must be refused, but it was {}",
            block.len(),
            describe(&taken)
        );
        // The same block announced to continue: refused before a CONTINUATION arrives.
        let taken = Blocks::default().take(Frame {
            kind: HEADERS,
            flags: 0,
            stream: 1,
            payload: &block,
        });
        assert!(
            matches!(taken, Err(ShimError::TooLarge(..))),
            "an unfinished HEADERS frame of {} bytes must be refused, but it was {}",
            block.len(),
            describe(&taken)
        );
    }

    #[test]
    fn a_block_one_byte_over_the_limit_across_continuations_is_refused() {
        let mut state = Blocks::default();
        let block = vec![0u8; MAX_HEADER_BLOCK + 1];
        let (first, rest) = block.split_at(MAX_HEADER_BLOCK);
        let frame = |kind, flags, payload| Frame {
            kind,
            flags,
            stream: 1,
            payload,
        };
        assert!(matches!(
            state.take(frame(HEADERS, 0, first)),
            Ok(Taken::Pending)
        ));
        let taken = state.take(frame(CONTINUATION, END_HEADERS, rest));
        assert!(matches!(taken, Err(ShimError::TooLarge(..))));
    }

    #[test]
    fn references_into_the_table_cannot_blow_a_block_up() {
        // One entry of about 4 KiB, then a block of a thousand one-byte references to it.
        let mut state = Blocks::default();
        let mut block = Vec::new();
        indexed_literal(&mut block, b"x-big", &[b'v'; 4000]);
        whole_block(&mut state, 1, &block).unwrap();
        let references = vec![0x80 | 62; 1000];
        let taken = whole_block(&mut state, 3, &references);
        assert!(
            matches!(taken, Err(ShimError::TooLarge(..))),
            "1000 bytes decoding to 4 MB must be refused, but it was {}",
            describe(&taken)
        );
    }

    #[tokio::test]
    async fn a_refused_block_ends_the_connection_before_it_reaches_the_server() {
        let mut block = Vec::new();
        push_int(&mut block, 0x20, 5, TABLE_SIZE + 1);
        block.extend_from_slice(&encode(&[(b"a".to_vec(), b"b".to_vec())]));
        let mut client = PREFACE.to_vec();
        push_frame(&mut client, HEADERS, END_HEADERS, 1, &[&block]);
        // Whatever follows is not read.
        push_frame(&mut client, 0x0, 0, 1, &[b"data"]);
        let mut server = Vec::new();
        let result = rewrite(&mut &client[..], &mut server).await;
        assert!(matches!(result, Err(ShimError::Hpack(_))), "{result:?}");
        assert_eq!(server, PREFACE);
    }

    /// A frame larger than the server allows is refused on its header, before its payload is
    /// waited for or buffered (a client could otherwise make every connection hold 16 MiB).
    #[tokio::test]
    async fn a_frame_over_the_size_the_server_allows_is_refused_unread() {
        let mut client = PREFACE.to_vec();
        let len = MAX_FRAME + 1;
        client.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8]);
        client.extend_from_slice(&[0x0, 0, 0, 0, 0, 1]);
        // Only part of the payload ever arrives.
        client.extend_from_slice(&[0u8; 100]);
        let mut server = Vec::new();
        let result = rewrite(&mut &client[..], &mut server).await;
        assert!(matches!(result, Err(ShimError::Frame(_))), "{result:?}");
        assert_eq!(server, PREFACE);
    }
}
