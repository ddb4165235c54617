//! A live service's mark on the host: an abstract unix socket named for its
//! instance (`blockplane-instance-<id>`), bound for the life of the process.
//!
//! dm devices name their instance (in their DM uuid) but no file whose lock
//! would show a live holder. The kernel drops an abstract socket with the
//! last descriptor of it, however the process ends, so nothing a crash
//! leaves behind reads as live, and a pid reused by another process does not
//! either. The socket is close-on-exec: workers do not keep it, so an
//! instance whose service is gone is not live even while its workers run.
//! Abstract sockets belong to a network namespace: a service sees only the
//! instances of its own (the host's, under systemd; the pod's, in Kubernetes).

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Held while the service lives: its instance counts as live.
#[derive(Debug)]
pub struct Alive {
    _socket: UnixDatagram,
}

fn address(instance: &str) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("blockplane-instance-{instance}"))
}

/// Marks `instance` live until the returned value is dropped. Fails with
/// `AddrInUse` when another live process holds the mark: the same instance
/// (a copy of this registry) served from another data dir.
pub fn claim(instance: &str) -> io::Result<Alive> {
    Ok(Alive {
        _socket: UnixDatagram::bind_addr(&address(instance)?)?,
    })
}

/// Whether a live service holds `instance`'s mark.
pub fn is_live(instance: &str) -> bool {
    let (Ok(addr), Ok(probe)) = (address(instance), UnixDatagram::unbound()) else {
        return false;
    };
    // Connecting a datagram socket only names its peer: it succeeds while
    // the name is bound, and is refused once it is not.
    probe.connect_addr(&addr).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_is_live_while_its_mark_is_held_and_only_once() {
        let instance = format!("test-{}", uuid::Uuid::new_v4().simple());
        assert!(!is_live(&instance));
        let alive = claim(&instance).unwrap();
        assert!(is_live(&instance));
        assert_eq!(
            claim(&instance).unwrap_err().kind(),
            io::ErrorKind::AddrInUse
        );
        drop(alive);
        assert!(!is_live(&instance));
    }
}
