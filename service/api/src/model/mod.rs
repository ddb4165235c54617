//! The API's data model: request and response bodies of `/v1`, shared by the
//! server, the CLI, the CSI driver and the tests. Nothing here does I/O.
//!
//! One module per concept; every type is re-exported here, so users name
//! them `blockplane_api::model::X` whatever module they live in.

mod backend;
mod error;
mod event;
mod host;
mod image;
mod qos;
mod size;
mod stats;
mod usage;
mod volume;

pub use backend::*;
pub use error::*;
pub use event::*;
pub use host::*;
pub use image::*;
pub use qos::*;
pub use size::*;
pub use stats::*;
pub use usage::*;
pub use volume::*;

#[cfg(test)]
mod tests {
    use super::*;

    /// Each `as_str` agrees with serde: they are two spellings of one name.
    #[test]
    fn as_str_is_the_wire_spelling() {
        fn check<T: serde::Serialize>(all: &[T], as_str: impl Fn(&T) -> &'static str) {
            for v in all {
                assert_eq!(serde_json::to_value(v).unwrap(), as_str(v));
            }
        }
        use ActiveDispatch as A;
        use DispatchPolicy as D;
        check(&[Allocation::Sparse, Allocation::Full], |v| v.as_str());
        check(&[CopyMethod::Reflink, CopyMethod::Copy], |v| v.as_str());
        check(
            &[ImageState::Ready, ImageState::Copying, ImageState::Failed],
            |v| v.as_str(),
        );
        check(
            &[
                AllocateState::Running,
                AllocateState::Done,
                AllocateState::Failed,
                AllocateState::Cancelled,
            ],
            |v| v.as_str(),
        );
        check(&[Backend::Loop, Backend::Ublk, Backend::Dm], |v| v.as_str());
        check(
            &[
                BackendChoice::Auto,
                BackendChoice::Loop,
                BackendChoice::Ublk,
                BackendChoice::Dm,
            ],
            |v| v.as_str(),
        );
        check(&[D::Auto, D::Nowait, D::Threaded, D::Direct], |v| {
            v.as_str()
        });
        check(&[A::Nowait, A::Threaded, A::Direct, A::Kernel], |v| {
            v.as_str()
        });
        check(&[CopyMode::Copy, CopyMode::ZeroCopy], |v| v.as_str());
        check(
            &[
                VolumeState::Attaching,
                VolumeState::Attached,
                VolumeState::Degraded,
                VolumeState::Detaching,
                VolumeState::Error,
            ],
            |v| v.as_str(),
        );
    }
}
