//! Two hosts in one VM, for tests of volumes that leave their host: host A
//! in a network namespace of its own, host B in the VM's, joined by a veth
//! pair. B stays in the initial namespace because the kernel's NVMe/TCP
//! initiator reconnects from a kernel worker whose socket is made there: a
//! consumer in a child namespace loses its controller for good at the
//! first blip (seen on 6.12 and 7.3: `connecting`, then gone), one in the
//! initial namespace reconnects.

use std::process::Command;

/// Host A's address on the veth pair.
pub const A_IP: &str = "10.99.0.1";
/// Host B's address on the veth pair.
pub const B_IP: &str = "10.99.0.2";

/// A's network namespace and the veth pair to it; dropped, both go.
pub struct Hosts {
    /// A's namespace, `/run/netns/<a>` (a service runs in it with
    /// [`crate::harness::Opts::netns`]).
    pub a: String,
    /// B's end of the veth pair.
    b_end: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Hosts {
    /// Makes A's namespace and the veth pair, with their addresses, up.
    pub fn new() -> Self {
        let tag = std::process::id();
        let (a, va, vb) = (format!("bpa{tag}"), format!("va{tag}"), format!("vb{tag}"));
        ip(&["netns", "add", &a]);
        ip(&["-n", &a, "link", "set", "lo", "up"]);
        ip(&[
            "link", "add", &vb, "type", "veth", "peer", "name", &va, "netns", &a,
        ]);
        ip(&["-n", &a, "addr", "add", &format!("{A_IP}/24"), "dev", &va]);
        ip(&["-n", &a, "link", "set", &va, "up"]);
        ip(&["addr", "add", &format!("{B_IP}/24"), "dev", &vb]);
        ip(&["link", "set", &vb, "up"]);
        Self { a, b_end: vb }
    }

    /// Cuts the network between A and B (B's end of the pair down):
    /// packets are lost, connections stay until their timeouts.
    pub fn cut(&self) {
        ip(&["link", "set", &self.b_end, "down"]);
    }

    /// Mends what [`Hosts::cut`] cut.
    pub fn mend(&self) {
        ip(&["link", "set", &self.b_end, "up"]);
    }
}

impl Default for Hosts {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Hosts {
    /// The veth pair goes with A's namespace.
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.a]).status();
    }
}
