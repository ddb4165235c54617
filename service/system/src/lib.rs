//! What blockplane asks of the host's kernel, without a runtime or a
//! database: image files under their roots ([`image`]), their extents and the
//! direct-map rules ([`extent`]), the dispatch decision built on them
//! ([`dispatch`]), device-mapper tables ([`dm`]), the mount table
//! ([`mountinfo`]), the processes holding files open ([`holders`]), the
//! kernel's per-device statistics ([`blockstat`]), LUKS2 encryption of
//! images ([`crypt`]), the page cache a file or
//! device holds ([`pagecache`]), which build of blockplane an executable
//! file is ([`build`]), and NVMe over TCP: the kernel's target, configured
//! through configfs ([`nvmet`]), its initiator ([`fabrics`]), and the
//! DH-HMAC-CHAP secrets they authenticate each other with ([`dhchap`]),
//! and who is connected to a listening address ([`tcp`]).
//! The control plane and the worker both build on it.

pub mod blockstat;
pub mod build;
pub mod changes;
pub mod crypt;
pub mod dhchap;
pub mod dispatch;
pub mod dm;
pub mod extent;
pub mod fabrics;
pub mod holders;
pub mod image;
mod kmod;
pub mod mountinfo;
pub mod nvmet;
pub mod pagecache;
pub mod tcp;
