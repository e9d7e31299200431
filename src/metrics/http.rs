//! The HTTP side: `GET /metrics` on the address `-o metrics=` names. [`serve_with`] serves
//! any exposition the same way (the containerd snapshotter's, for one).
//!
//! The server has a thread and a single-threaded runtime of its own, so a slow scraper
//! never takes a thread that serves FUSE requests or the control socket, and the FUSE side
//! needs no runtime. It binds before the mount is made: an address that cannot be had fails
//! the mount instead of leaving it silently unobservable.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{Error, Metrics};

/// A client must send its request headers within this time.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// No connection lives longer than this, however it behaves.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);

/// The running server; dropping it stops it.
pub struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// The address bound, with the port chosen when port 0 was asked for.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Makes one scrape's exposition in the Prometheus text format ([`super::CONTENT_TYPE`]), or
/// says why it cannot. Called on the server's thread, once per scrape.
pub type Render = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

/// Binds `addr` and serves `metrics` on it until the returned [`Server`] is dropped.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<Server, Error> {
    serve_with(addr, Arc::new(move || metrics.encode()))
}

/// Binds `addr` and serves what `render` makes on it until the returned [`Server`] is
/// dropped.
pub fn serve_with(addr: SocketAddr, render: Render) -> Result<Server, Error> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|source| Error::Bind { addr, source })?;
    let bound = listener.local_addr().map_err(Error::Start)?;
    listener.set_nonblocking(true).map_err(Error::Start)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(Error::Start)?;
    let listener = {
        let _inside = runtime.enter();
        tokio::net::TcpListener::from_std(listener).map_err(Error::Start)?
    };
    let (stop, stopped) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || runtime.block_on(accept(listener, render, stopped)))
        .map_err(Error::Start)?;
    info!(address = %bound, "serving metrics over HTTP at /metrics");
    Ok(Server {
        addr: bound,
        stop: Some(stop),
        thread: Some(thread),
    })
}

async fn accept(
    listener: tokio::net::TcpListener,
    render: Render,
    mut stopped: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(connection(stream, peer, render.clone()));
                }
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    warn!(error = %e, "metrics: cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// The largest request head accepted; a scrape's is a few hundred bytes.
const MAX_HEAD: usize = 16 * 1024;

/// Serves one connection: GET or HEAD requests without bodies, kept alive as HTTP/1.1 asks,
/// until the client closes, sends something else, or the time limits run out. A scrape
/// endpoint needs no more of HTTP than this, and the daemon links no HTTP stack for it.
async fn connection(stream: tokio::net::TcpStream, peer: SocketAddr, render: Render) {
    match tokio::time::timeout(CONNECTION_TIMEOUT, serve_requests(stream, &*render)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => debug!(%peer, error = %e, "metrics: connection ended with an error"),
        Err(_) => debug!(%peer, "metrics: connection closed after the time limit"),
    }
}

async fn serve_requests(
    mut stream: tokio::net::TcpStream,
    render: &(dyn Fn() -> Result<String, String> + Send + Sync),
) -> std::io::Result<()> {
    let mut buffer = Vec::with_capacity(1024);
    loop {
        let head_len =
            match tokio::time::timeout(HEADER_TIMEOUT, read_head(&mut stream, &mut buffer)).await {
                Ok(Ok(Some(len))) => len,
                Ok(Ok(None)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(()),
            };
        let head = String::from_utf8_lossy(&buffer[..head_len]).into_owned();
        buffer.drain(..head_len);
        let request = Request::parse(&head);
        let (mut response, keep) = match &request {
            Some(request) => (respond(request, render), request.keep_alive()),
            None => (plain(400, "Bad Request", "bad request\n"), false),
        };
        if !keep {
            response.push_str_header("Connection", "close");
        }
        stream
            .write_all(&response.encode(request.as_ref().is_some_and(|r| r.method == "HEAD")))
            .await?;
        if !keep {
            return stream.shutdown().await;
        }
    }
}

/// Reads until `buffer` holds a whole request head; returns its length with the blank line,
/// or `None` when the client closed between requests.
async fn read_head(
    stream: &mut tokio::net::TcpStream,
    buffer: &mut Vec<u8>,
) -> std::io::Result<Option<usize>> {
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some(end + 4));
        }
        if buffer.len() > MAX_HEAD {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "request head too large",
            ));
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return if buffer.is_empty() {
                Ok(None)
            } else {
                Err(std::io::ErrorKind::UnexpectedEof.into())
            };
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// What the server needs of a request: the request line and whether to keep the connection.
struct Request<'a> {
    method: &'a str,
    path: &'a str,
    http10: bool,
    close: bool,
    has_body: bool,
}

impl<'a> Request<'a> {
    fn parse(head: &'a str) -> Option<Request<'a>> {
        let mut lines = head.split("\r\n");
        let mut parts = lines.next()?.split(' ');
        let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !version.starts_with("HTTP/1.") {
            return None;
        }
        let path = target.split('?').next().unwrap_or(target);
        let mut request = Request {
            method,
            path,
            http10: version == "HTTP/1.0",
            close: false,
            has_body: false,
        };
        for line in lines.filter(|l| !l.is_empty()) {
            let (name, value) = line.split_once(':')?;
            let value = value.trim();
            if name.eq_ignore_ascii_case("connection") {
                request.close = value.eq_ignore_ascii_case("close");
            } else if name.eq_ignore_ascii_case("content-length") {
                request.has_body |= value != "0";
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                request.has_body = true;
            }
        }
        Some(request)
    }

    /// A body would have to be read and skipped; requests with one are answered and closed.
    fn keep_alive(&self) -> bool {
        !self.http10 && !self.close && !self.has_body
    }
}

/// A response as written on the wire.
struct Response {
    status: u16,
    reason: &'static str,
    headers: Vec<(&'static str, String)>,
    body: String,
}

impl Response {
    fn push_str_header(&mut self, name: &'static str, value: &str) {
        self.headers.push((name, value.to_owned()));
    }

    fn encode(&self, head_only: bool) -> Vec<u8> {
        let mut out = format!("HTTP/1.1 {} {}\r\n", self.status, self.reason);
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str(&format!("Content-Length: {}\r\n\r\n", self.body.len()));
        let mut bytes = out.into_bytes();
        if !head_only {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}

fn respond(
    request: &Request<'_>,
    render: &(dyn Fn() -> Result<String, String> + Send + Sync),
) -> Response {
    if request.path != "/metrics" {
        return plain(404, "Not Found", "not found: metrics are at /metrics\n");
    }
    if request.method != "GET" && request.method != "HEAD" {
        let mut response = plain(405, "Method Not Allowed", "only GET\n");
        response.push_str_header("Allow", "GET, HEAD");
        return response;
    }
    match render() {
        Ok(body) => Response {
            status: 200,
            reason: "OK",
            headers: vec![("Content-Type", super::CONTENT_TYPE.to_owned())],
            body,
        },
        Err(message) => {
            warn!(error = %message, "metrics: scrape failed");
            plain(500, "Internal Server Error", &format!("{message}\n"))
        }
    }
}

fn plain(status: u16, reason: &'static str, text: &str) -> Response {
    Response {
        status,
        reason,
        headers: vec![("Content-Type", "text/plain; charset=utf-8".to_owned())],
        body: text.to_owned(),
    }
}
