//! The HTTP side: `GET /metrics` on the address `-o metrics=` names.
//!
//! The server has a thread and a single-threaded runtime of its own, so a slow scraper
//! never takes a thread that serves FUSE requests or the control socket, and the FUSE side
//! needs no runtime. It binds before the mount is made: an address that cannot be had fails
//! the mount instead of leaving it silently unobservable.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
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

/// Binds `addr` and serves `metrics` on it until the returned [`Server`] is dropped.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<Server, Error> {
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
        .spawn(move || runtime.block_on(accept(listener, metrics, stopped)))
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
    metrics: Arc<Metrics>,
    mut stopped: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(connection(stream, peer, metrics.clone()));
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

async fn connection(stream: tokio::net::TcpStream, peer: SocketAddr, metrics: Arc<Metrics>) {
    let service = service_fn(move |request| {
        let metrics = metrics.clone();
        async move { Ok::<_, Infallible>(respond(&request, &metrics)) }
    });
    let served = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(CONNECTION_TIMEOUT, served).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => debug!(%peer, error = %e, "metrics: connection ended with an error"),
        Err(_) => debug!(%peer, "metrics: connection closed after the time limit"),
    }
}

fn respond(request: &Request<Incoming>, metrics: &Metrics) -> Response<String> {
    if request.uri().path() != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics\n",
        );
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match metrics.encode() {
        Ok(body) => {
            let mut response = Response::new(body);
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(super::CONTENT_TYPE));
            response
        }
        Err(message) => {
            warn!(error = %message, "metrics: scrape failed");
            plain(StatusCode::INTERNAL_SERVER_ERROR, &format!("{message}\n"))
        }
    }
}

fn plain(status: StatusCode, text: &str) -> Response<String> {
    let mut response = Response::new(text.to_owned());
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
