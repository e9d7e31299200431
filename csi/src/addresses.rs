//! Which addresses a download may connect to. The driver runs as root inside the cluster:
//! unless the operator allows them, loopback, link-local and private addresses (in every
//! IPv6 spelling of them) and the node's own addresses are refused, and the check is made
//! on the addresses actually connected to ([`CheckedResolver`]).

use std::net::IpAddr;

use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

/// Whether a download may not connect to `ip`: a private address (in any spelling), or one of
/// `own`, the node's addresses (a public one too: through it a URL reaches the node's own
/// services, which may trust their host).
pub(crate) fn refused_ip(ip: &IpAddr, own: &[IpAddr]) -> bool {
    is_private(ip) || own.iter().any(|o| canonical(o) == canonical(ip))
}

/// An IPv6 address that embeds an IPv4 one (mapped, compatible, NAT64) as that IPv4 address,
/// so that each spelling of an address compares equal.
fn canonical(ip: &IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(*ip, IpAddr::V4),
        IpAddr::V4(_) => *ip,
    }
}

/// The IPv4 address an IPv6 one stands for: IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible
/// `::a.b.c.d` (deprecated, but still routed to the IPv4 address by some stacks) and NAT64
/// `64:ff9b::/96` and `64:ff9b:1::/48` (a translator turns them into the IPv4 address).
fn embedded_v4(v6: &std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    let s = v6.segments();
    let last =
        std::net::Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    if s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified() {
        return Some(last);
    }
    if s[0] == 0x64 && s[1] == 0xff9b && (s[2..6] == [0; 4] || s[2] == 1) {
        return Some(last);
    }
    None
}

/// Every address of the node's interfaces (getifaddrs), read at each check: interfaces and
/// their addresses come and go (pods, DHCP). An error yields none; the private ranges are
/// still refused.
pub fn own_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below with freeifaddrs; each entry's
    // address is read only when present, as the sockaddr type its family says.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "cannot list the node's addresses");
            return out;
        }
        let mut cur = head;
        while !cur.is_null() {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() {
                match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(addr as *const libc::sockaddr_in);
                        out.push(IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(
                            sin.sin_addr.s_addr,
                        ))));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(addr as *const libc::sockaddr_in6);
                        out.push(IpAddr::V6(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    out
}

/// A name resolver that checks what it resolves: unless private addresses are allowed, a
/// name with any loopback, link-local or private address is refused. ureq connects only to
/// the addresses a resolver returns, so the address checked is the address connected to: a
/// name cannot resolve to a public address for a check and to a private one for the
/// connection (DNS rebinding). Every redirect is a new connection, resolved and checked again.
#[derive(Debug)]
pub struct CheckedResolver<R = DefaultResolver> {
    pub inner: R,
    pub allow_private: bool,
}

/// What [`CheckedResolver`] refused, carried through ureq's error.
#[derive(Debug)]
pub(crate) struct RefusedAddress(String);

impl std::fmt::Display for RefusedAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RefusedAddress {}

impl<R: Resolver> Resolver for CheckedResolver<R> {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> std::result::Result<ResolvedSocketAddrs, ureq::Error> {
        let addrs = self.inner.resolve(uri, config, timeout)?;
        if !self.allow_private {
            let own = own_addresses();
            if let Some(bad) = addrs.iter().find(|a| refused_ip(&a.ip(), &own)) {
                return Err(ureq::Error::Other(Box::new(RefusedAddress(format!(
                    "{} resolves to {}",
                    uri.host().unwrap_or_default(),
                    bad.ip()
                )))));
            }
        }
        tracing::debug!(host = ?uri.host(), addrs = ?addrs.iter().collect::<Vec<_>>(), "resolved download host");
        Ok(addrs)
    }
}

/// Loopback, link-local, private (RFC 1918, unique local, shared), unspecified and broadcast
/// addresses, also spelled as IPv6 ([`embedded_v4`]).
pub fn is_private(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return is_private(&IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
        }
    }
}
