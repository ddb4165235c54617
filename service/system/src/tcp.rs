//! The TCP connections of this process's network namespace, as the kernel
//! lists them in `/proc/self/net/tcp` and `tcp6`: who is connected to an
//! address this host listens on. The kernel's NVMe target says which
//! subsystem a controller belongs to only through a debugfs that neither
//! supported kernel builds, so whether anyone is connected to its port at
//! all is what can be known.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::nvmet::ListenAddr;

/// The kernel's number for an established connection (`st` column).
const ESTABLISHED: &str = "01";

/// The remote ends of the established connections to `addr` (its IP, or
/// any IP when it listens on the unspecified one, and its port).
pub fn peers_of(addr: &ListenAddr) -> io::Result<Vec<IpAddr>> {
    let mut peers = Vec::new();
    for (file, v6) in [("/proc/self/net/tcp", false), ("/proc/self/net/tcp6", true)] {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            // A kernel without IPv6 has no tcp6.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        peers.extend(
            established(&text, v6)
                .filter(|(local, _)| {
                    local.port() == addr.port
                        && (addr.ip.is_unspecified() || same_ip(local.ip(), addr.ip))
                })
                .map(|(_, remote)| remote.ip()),
        );
    }
    Ok(peers)
}

/// IPv4 addresses compare equal to their IPv4-mapped IPv6 form.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    let canonical = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    canonical(a) == canonical(b)
}

/// `(local, remote)` of each established connection in one table.
fn established(text: &str, v6: bool) -> impl Iterator<Item = (SocketAddr, SocketAddr)> + '_ {
    text.lines().skip(1).filter_map(move |line| {
        let mut cols = line.split_whitespace().skip(1);
        let local = cols.next()?;
        let remote = cols.next()?;
        (cols.next()? == ESTABLISHED).then_some(())?;
        Some((endpoint(local, v6)?, endpoint(remote, v6)?))
    })
}

/// `0100007F:1144` (IPv4) or 32 hex digits and a port (IPv6): the address
/// in the kernel's byte order, 32 bits at a time, and the port in hex.
fn endpoint(text: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16).ok())
        .collect::<Option<_>>()?;
    let ip = match (v6, words.as_slice()) {
        (false, [w]) => IpAddr::V4(Ipv4Addr::from(w.swap_bytes())),
        (true, [a, b, c, d]) => {
            let mut bytes = [0u8; 16];
            for (i, w) in [a, b, c, d].into_iter().enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn established_connections_are_read_from_the_kernels_table() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100630A:1144 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100630A:1144 0200630A:D3C8 01 00000000:00000000 00:00000000 00000000     0        0 0 1 0000000000000000 20 4 0 10 -1
   2: 0100007F:1F90 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 0 1 0000000000000000 20 4 0 10 -1
";
        let got: Vec<_> = established(text, false).collect();
        assert_eq!(
            got,
            vec![
                (
                    "10.99.0.1:4420".parse().unwrap(),
                    "10.99.0.2:54216".parse().unwrap()
                ),
                (
                    "127.0.0.1:8080".parse().unwrap(),
                    "127.0.0.1:40960".parse().unwrap()
                ),
            ]
        );
    }

    #[test]
    fn ipv6_endpoints_and_mapped_ipv4_compare_as_the_kernel_means_them() {
        // ::1 port 4420, as the kernel prints it on x86.
        let ep = endpoint("00000000000000000000000001000000:1144", true).unwrap();
        assert_eq!(ep, "[::1]:4420".parse().unwrap());
        assert!(same_ip(
            "::ffff:10.99.0.1".parse().unwrap(),
            "10.99.0.1".parse().unwrap()
        ));
    }
}
