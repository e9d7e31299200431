//! gRPC clients other than Go's reach the driver. grpc-core (Python, C++, grpcurl) sends the
//! socket path as `:authority`; this test speaks HTTP/2 by hand to send exactly that, so it
//! needs no client library that would fill the authority in its own way.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_layerfs-csi");

/// A running driver in a temp dir; killed on drop.
struct Driver {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Driver {
    fn start() -> Driver {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let child = Command::new(BIN)
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--node-id", "node1", "--store"])
            .arg(dir.path().join("store"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start layerfs-csi");
        let driver = Driver {
            child,
            socket,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&driver.socket).is_err() {
            assert!(Instant::now() < deadline, "the driver never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        driver
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// What came back on stream 1: response headers and trailers (decoded) and the DATA bytes.
#[derive(Default, Debug)]
struct Answer {
    headers: Vec<(String, String)>,
    data: Vec<u8>,
    reset: Option<u32>,
}

/// Calls Identity/GetPluginInfo with `authority` as `:authority`, the way grpc-core does.
fn get_plugin_info(socket: &Path, authority: &str) -> Answer {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut encoder = loona_hpack::Encoder::new();
    let block = encoder.encode([
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", b"/csi.v1.Identity/GetPluginInfo"),
        (b":authority", authority.as_bytes()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]);
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    out.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS
    out.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // DATA: an empty message, END_STREAM
    stream.write_all(&out).unwrap();

    let mut decoder = loona_hpack::Decoder::new();
    let mut answer = Answer::default();
    loop {
        let mut head = [0u8; 9];
        stream.read_exact(&mut head).expect("the server hung up");
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).unwrap();
        let (kind, flags) = (head[3], head[4]);
        let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        match kind {
            0x4 if flags & 0x1 == 0 => stream.write_all(&frame(0x4, 0x1, 0, &[])).unwrap(),
            0x7 => panic!("GOAWAY: {payload:?}"),
            _ if id != 1 => {}
            0x0 => answer.data.extend_from_slice(&payload),
            0x1 => {
                assert_ne!(flags & 0x4, 0, "the server split its headers");
                for (name, value) in decoder.decode(&payload).unwrap() {
                    answer.headers.push((
                        String::from_utf8(name).unwrap(),
                        String::from_utf8(value).unwrap(),
                    ));
                }
            }
            0x3 => {
                answer.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                return answer;
            }
            _ => {}
        }
        if flags & 0x1 != 0 && (kind == 0x0 || kind == 0x1) {
            return answer;
        }
    }
}

#[test]
fn a_client_that_sends_the_socket_path_as_authority_is_answered() {
    let driver = Driver::start();
    let path = driver.socket.display().to_string();
    for authority in [path.as_str(), "localhost", "unix:%2Frun%2Fcsi.sock"] {
        let answer = get_plugin_info(&driver.socket, authority);
        assert_eq!(answer.reset, None, "{authority}: stream reset");
        assert!(
            answer.headers.contains(&("grpc-status".into(), "0".into())),
            "{authority}: {answer:?}"
        );
        let text = String::from_utf8_lossy(&answer.data);
        assert!(text.contains("layerfs.csi.io"), "{authority}: {text:?}");
    }
}
