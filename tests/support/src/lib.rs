//! What blockplane's test targets share: a real service process and its
//! HTTP client checked against the OpenAPI document ([`harness`]), waiting
//! for conditions ([`wait`]), other builds of the binary ([`builds`]), leak
//! checks ([`leaks`]) and moving an image's blocks under a volume
//! ([`drift`]). Used by the black-box, CSI and kernel (VM) targets of the
//! `blockplane` crate.

pub mod builds;
pub mod drift;
pub mod harness;
pub mod leaks;
pub mod wait;
