//! A tiny HTTP/1.1 file server on 127.0.0.1, for the tests of images the driver downloads:
//! it can hold its answers back, stall a body halfway, and label a body with a Content-Type,
//! which is what a download in progress, a stalled one and an HTML answer need.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A tiny HTTP/1.1 file server on 127.0.0.1 for download tests.
/// Answers wait while `hold` is set, to keep a download in progress.
pub struct HttpServer {
    pub port: u16,
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    pub hold: Arc<std::sync::atomic::AtomicBool>,
    /// Paths whose body stops after this many bytes (the connection stays open, silent).
    pub stalls: Arc<Mutex<HashMap<String, usize>>>,
    /// The Content-Type sent for a path (none by default).
    pub types: Arc<Mutex<HashMap<String, String>>>,
    /// Requests received.
    requests: Arc<std::sync::atomic::AtomicUsize>,
}

impl HttpServer {
    pub fn start() -> HttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("local addr").port();
        let files: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let served = Arc::clone(&files);
        let hold: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let held = Arc::clone(&hold);
        let stalls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let stalling = Arc::clone(&stalls);
        let types: Arc<Mutex<HashMap<String, String>>> = Arc::default();
        let typing = Arc::clone(&types);
        let requests: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let counted = Arc::clone(&requests);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let files = Arc::clone(&served);
                let held = Arc::clone(&held);
                let stalling = Arc::clone(&stalling);
                let typing = Arc::clone(&typing);
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while held.load(std::sync::atomic::Ordering::SeqCst)
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        match stream.read(&mut byte) {
                            Ok(1) => head.push(byte[0]),
                            _ => return,
                        }
                    }
                    let head = String::from_utf8_lossy(&head);
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    let body = files.lock().map(|f| f.get(&path).cloned()).unwrap_or(None);
                    let stall = stalling
                        .lock()
                        .map(|s| s.get(&path).copied())
                        .unwrap_or(None);
                    let kind = typing
                        .lock()
                        .map(|t| t.get(&path).map(|t| format!("Content-Type: {t}\r\n")))
                        .unwrap_or(None)
                        .unwrap_or_default();
                    if let (Some(body), Some(after)) = (&body, stall) {
                        let _ = stream
                            .write_all(
                                format!(
                                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                                    body.len()
                                )
                                .as_bytes(),
                            )
                            .and_then(|()| stream.write_all(&body[..after.min(body.len())]))
                            .and_then(|()| stream.flush());
                        std::thread::sleep(Duration::from_secs(60));
                        return;
                    }
                    let _ = match body {
                        Some(body) => stream
                            .write_all(
                                format!(
                                    "HTTP/1.1 200 OK\r\n{kind}Content-Length: {}\r\nConnection: close\r\n\r\n",
                                    body.len()
                                )
                                .as_bytes(),
                            )
                            .and_then(|()| stream.write_all(&body)),
                        None => stream.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        ),
                    };
                });
            }
        });
        HttpServer {
            port,
            files,
            hold,
            stalls,
            types,
            requests,
        }
    }

    pub fn requests(&self) -> usize {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn serve(&self, path: &str, body: Vec<u8>) -> String {
        self.files
            .lock()
            .expect("files")
            .insert(path.to_owned(), body);
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}
