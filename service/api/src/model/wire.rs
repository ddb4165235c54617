//! The API's spelling of its enumerations, read from text: CLI flags and
//! StorageClass parameters take the same values as the JSON.

use serde::de::value::{Error, StrDeserializer};
use serde::de::{DeserializeOwned, IntoDeserializer};

/// The value of a unit-variant enum of the model spelled `name` as in the
/// API (`"ublk"`, `"zero_copy"`); `None` when no variant is spelled so.
pub fn parse_wire<T: DeserializeOwned>(name: &str) -> Option<T> {
    let name: StrDeserializer<'_, Error> = name.into_deserializer();
    T::deserialize(name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    /// Each `as_str` agrees with serde, and [`parse_wire`] reads it back.
    #[test]
    fn as_str_is_the_wire_spelling() {
        fn check<T>(all: &[T], as_str: impl Fn(&T) -> &'static str)
        where
            T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
        {
            for v in all {
                assert_eq!(serde_json::to_value(v).unwrap(), as_str(v));
                assert_eq!(parse_wire::<T>(as_str(v)).as_ref(), Some(v));
            }
            assert_eq!(parse_wire::<T>("no_such_name"), None);
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
        check(
            &[D::Auto, D::Nowait, D::Threaded, D::Direct, D::Kernel],
            |v| v.as_str(),
        );
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
                VolumeState::Locked,
                VolumeState::Recovering,
            ],
            |v| v.as_str(),
        );
        check(&[ExportAuth::Dhchap, ExportAuth::None], |v| v.as_str());
        check(
            &[
                ExportState::Serving,
                ExportState::Waiting,
                ExportState::Error,
            ],
            |v| v.as_str(),
        );
        check(
            &[
                RemoteState::Connecting,
                RemoteState::Attached,
                RemoteState::Reconnecting,
                RemoteState::Error,
            ],
            |v| v.as_str(),
        );
    }
}
