//! Blocking work (ioctls, file creation, the kernel's answers) run off the
//! async threads.

use super::error::{Error, Result};

/// Runs blocking work (ioctls, file creation) off the async threads.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task failed: {e}")))
}
