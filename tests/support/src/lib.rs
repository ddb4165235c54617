//! What blockplane's test targets share: a real service process and its
//! HTTP client checked against the OpenAPI document ([`harness`]), waiting
//! for conditions ([`wait`]), other builds of the binary ([`builds`]), leak
//! checks ([`leaks`]), moving an image's blocks under a volume ([`drift`])
//! and the test S3 server ([`s3`]). Used by the black-box, CSI and kernel (VM) targets of the
//! `blockplane` crate, and by the backup crate's tests.

pub mod builds;
pub mod drift;
pub mod harness;
pub mod hosts;
pub mod leaks;
pub mod s3;
pub mod wait;
