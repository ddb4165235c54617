//! An opened target: the object store, the prefix everything lives under,
//! and the few operations the rest of the crate does on it, with errors
//! that name the target and the object.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    ClientOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};
use time::OffsetDateTime;

use crate::config::TargetConfig;
use crate::error::{Error, Result};

/// How long one operation on a target may go unanswered before the target
/// is taken for hung ([`Error::Hung`]), unless the service says otherwise
/// (`--backup-timeout-secs`): long enough for a 4 MiB chunk on a slow link.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A connection to S3 not made in this long is tried again.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// An opened target.
#[derive(Clone)]
pub struct Target {
    store: Arc<dyn ObjectStore>,
    /// A `Dir` target's store without an fsync per file, for chunks: a
    /// backup syncs their filesystem once ([`Target::settle`]) before its
    /// manifest, instead of once per 4 MiB.
    unsynced: Option<Arc<dyn ObjectStore>>,
    prefix: String,
    description: Arc<str>,
    /// The directory of a `Dir` target: listing a vanished mount point finds
    /// nothing rather than failing, so `check` looks at it itself.
    root: Option<std::path::PathBuf>,
    /// An operation unanswered for this long fails as [`Error::Hung`].
    hang_after: Duration,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("description", &self.description)
            .finish()
    }
}

/// An object listed on the target: its name under the listed folder and
/// when it was last written (by the target's clock).
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    pub name: String,
    pub path: Path,
    pub size: u64,
    pub last_modified: OffsetDateTime,
    pub e_tag: Option<String>,
}

/// Where an S3 target is, and who it is to the server.
struct S3Place<'a> {
    bucket: &'a str,
    region: &'a str,
    endpoint: Option<&'a str>,
    credentials: &'a crate::config::Credentials,
}

impl Target {
    /// Opens a target: a `Dir` must be an existing directory; an `S3` target
    /// is only configured here (use [`Target::check`] to reach it).
    ///
    /// `timeout` bounds every operation. On S3 it is each request's timeout
    /// and the window in which a request that failed (a 5xx such as 503
    /// SlowDown, a 429, a broken connection) is tried again with
    /// exponential backoff; an operation still unanswered after twice it
    /// fails. On a directory, whose calls block in the kernel (a hung NFS
    /// mount never returns), the call is abandoned after it: it fails, and
    /// the thread blocked in it stays until the mount answers.
    pub fn open(cfg: &TargetConfig, timeout: Duration) -> Result<Target> {
        let description: Arc<str> = cfg.describe().into();
        match cfg {
            TargetConfig::Dir { path } => Self::open_dir(path, description, timeout),
            TargetConfig::S3 {
                bucket,
                prefix,
                endpoint,
                region,
                credentials,
            } => {
                let s3 = S3Place {
                    bucket,
                    region,
                    endpoint: endpoint.as_deref(),
                    credentials,
                };
                Self::open_s3(&s3, prefix, description, timeout)
            }
        }
    }

    /// A directory target: an absolute path to a directory that exists.
    fn open_dir(
        path: &std::path::Path,
        description: Arc<str>,
        timeout: Duration,
    ) -> Result<Target> {
        if !path.is_absolute() {
            return Err(Error::Config(format!(
                "{description}: a directory target must be an absolute path"
            )));
        }
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::Config(format!("{description} is not a directory")));
            }
            Err(e) => {
                return Err(Error::Config(format!(
                    "{description}: the directory must exist (create it, or mount the share, first): {e}"
                )));
            }
        }
        // fsync: a manifest is written after its chunks and must
        // never survive a crash that they did not.
        let store = LocalFileSystem::new_with_prefix(path)
            .map_err(|e| Error::Config(format!("{description}: {e}")))?
            .with_fsync(true);
        let unsynced = LocalFileSystem::new_with_prefix(path)
            .map_err(|e| Error::Config(format!("{description}: {e}")))?;
        Ok(Target {
            store: Arc::new(store),
            unsynced: Some(Arc::new(unsynced)),
            prefix: String::new(),
            description,
            root: Some(path.to_path_buf()),
            hang_after: timeout,
        })
    }

    /// An S3 target, path-style, with `timeout` on every request.
    fn open_s3(
        s3: &S3Place<'_>,
        prefix: &str,
        description: Arc<str>,
        timeout: Duration,
    ) -> Result<Target> {
        install_tls_provider();
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(s3.bucket)
            .with_region(s3.region)
            .with_access_key_id(&s3.credentials.access_key_id)
            .with_secret_access_key(&s3.credentials.secret_access_key)
            // Path-style requests (`endpoint/bucket/key`) work with
            // every S3-compatible server and an IP endpoint.
            .with_virtual_hosted_style_request(false)
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(timeout)
                    .with_connect_timeout(timeout.min(CONNECT_TIMEOUT)),
            )
            .with_retry(RetryConfig {
                retry_timeout: timeout,
                ..RetryConfig::default()
            });
        if let Some(token) = &s3.credentials.session_token {
            b = b.with_token(token);
        }
        if let Some(e) = s3.endpoint {
            b = b.with_endpoint(e).with_allow_http(e.starts_with("http://"));
        }
        // The builder's error names options, never their values.
        let store = b
            .build()
            .map_err(|e| Error::Config(format!("{description}: {e}")))?;
        Ok(Target {
            store: Arc::new(store),
            unsynced: None,
            prefix: prefix.to_string(),
            description,
            root: None,
            // A retry begun just inside the window may take a whole
            // timeout more.
            hang_after: timeout * 2,
        })
    }

    /// Where it is: `dir:/path` or `s3://bucket/prefix (endpoint …)`; never credentials.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// A cheap reachability check: the first object under `backups/` is
    /// listed (one request). Errors say the target is unreachable and why.
    pub async fn check(&self) -> Result<()> {
        let unreachable = |reason: String| Error::Unreachable {
            target: self.description.to_string(),
            reason,
        };
        self.bounded(|| "looking at it".to_string(), async {
            if let Some(root) = &self.root {
                let root = root.clone();
                let m = tokio::task::spawn_blocking(move || std::fs::metadata(root))
                    .await
                    .map_err(|e| unreachable(e.to_string()))?;
                match m {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => return Err(unreachable("it is no longer a directory".to_string())),
                    Err(e) => return Err(unreachable(e.to_string())),
                }
            }
            let mut list = self.store.list(Some(&self.path("backups")));
            match list.next().await {
                None | Some(Ok(_)) => Ok(()),
                Some(Err(object_store::Error::NotFound { .. })) => Ok(()),
                Some(Err(e)) => Err(unreachable(crate::error::chain(&e))),
            }
        })
        .await
    }

    /// `op`, failed as [`Error::Hung`] when unanswered for `hang_after`.
    async fn bounded<T>(
        &self,
        action: impl FnOnce() -> String,
        op: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.hang_after, op).await {
            Ok(r) => r,
            Err(_) => Err(Error::Hung {
                target: self.description.to_string(),
                action: action(),
                secs: self.hang_after.as_secs(),
            }),
        }
    }

    /// The object path of `rel` (`chunks/ab/abcd…`) under the prefix.
    pub(crate) fn path(&self, rel: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(rel)
        } else {
            Path::from(format!("{}/{rel}", self.prefix))
        }
    }

    fn err(&self, action: String, error: object_store::Error) -> Error {
        Error::Target {
            target: self.description.to_string(),
            action,
            error,
        }
    }

    /// Puts an object, replacing any.
    pub(crate) async fn put(&self, path: &Path, data: Bytes) -> Result<()> {
        self.bounded(|| format!("writing {path}"), async {
            self.store
                .put(path, PutPayload::from(data))
                .await
                .map(|_| ())
                .map_err(|e| self.err(format!("writing {path}"), e))
        })
        .await
    }

    /// Puts a chunk, replacing any; on a `Dir` target not yet durable: call
    /// [`Target::settle`] before anything that relies on it is written.
    pub(crate) async fn put_chunk(&self, path: &Path, data: Bytes) -> Result<()> {
        self.bounded(|| format!("writing {path}"), async {
            self.unsynced
                .as_ref()
                .unwrap_or(&self.store)
                .put(path, PutPayload::from(data))
                .await
                .map(|_| ())
                .map_err(|e| self.err(format!("writing {path}"), e))
        })
        .await
    }

    /// Makes every chunk put so far durable: one `syncfs` of a `Dir`
    /// target's filesystem (an S3 put is durable when it is answered).
    pub(crate) async fn settle(&self) -> Result<()> {
        let Some(root) = self.root.clone() else {
            return Ok(());
        };
        self.bounded(|| "syncing the chunks written".to_string(), async {
            let synced = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                let dir = std::fs::File::open(&root)?;
                rustix::fs::syncfs(&dir)?;
                Ok(())
            })
            .await;
            crate::error::joined(synced).map_err(|e| {
                let error = object_store::Error::Generic {
                    store: "LocalFileSystem",
                    source: Box::new(e),
                };
                self.err("syncing the chunks written".to_string(), error)
            })
        })
        .await
    }

    /// Whether the target holds `data` intact at `path`, looked at as
    /// cheaply as the target allows: on S3 one HEAD, its size and its
    /// entity tag against the MD5 of `data` (a single-part put's tag is the
    /// MD5 of its bytes; a tag of another form, multipart or encrypted
    /// with a KMS key, is not, and then size and presence decide); on a
    /// directory, whose entity tag is of the inode and time, the file is
    /// read back and compared.
    pub(crate) async fn holds_chunk(&self, path: &Path, data: &Bytes) -> Result<Holding> {
        if self.root.is_some() {
            // The read tells presence and length too: no HEAD before it.
            return Ok(match self.get(path).await? {
                None => Holding::Missing,
                Some(stored) if stored == *data => Holding::Intact,
                Some(_) => Holding::Damaged,
            });
        }
        let Some(meta) = self.head(path).await? else {
            return Ok(Holding::Missing);
        };
        if meta.size != data.len() as u64 {
            return Ok(Holding::Damaged);
        }
        let Some(tag) = meta.e_tag.as_deref().map(|t| t.trim_matches('"')) else {
            return Ok(Holding::Intact);
        };
        if tag.len() != 32 || !tag.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(Holding::Intact);
        }
        let data = data.clone();
        let md5 = crate::error::joined(tokio::task::spawn_blocking(move || md5_hex(&data)).await);
        Ok(if tag.eq_ignore_ascii_case(&md5) {
            Holding::Intact
        } else {
            Holding::Damaged
        })
    }

    /// Reads an object; `None` when absent.
    pub(crate) async fn get(&self, path: &Path) -> Result<Option<Bytes>> {
        self.bounded(|| format!("reading {path}"), async {
            let r = match self.store.get(path).await {
                Ok(r) => r,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(self.err(format!("reading {path}"), e)),
            };
            match r.bytes().await {
                Ok(b) => Ok(Some(b)),
                // Deleted between the request and its body (a directory target).
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err(format!("reading {path}"), e)),
            }
        })
        .await
    }

    /// An object's metadata; `None` when absent.
    pub(crate) async fn head(&self, path: &Path) -> Result<Option<Listed>> {
        self.bounded(|| format!("reading the metadata of {path}"), async {
            match self.store.head(path).await {
                Ok(m) => Ok(Some(listed(m))),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err(format!("reading the metadata of {path}"), e)),
            }
        })
        .await
    }

    /// Deletes an object; deleting an absent one is no error.
    pub(crate) async fn delete(&self, path: &Path) -> Result<()> {
        self.bounded(|| format!("deleting {path}"), async {
            match self.store.delete(path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.err(format!("deleting {path}"), e)),
            }
        })
        .await
    }

    /// Every object under `folder` (`chunks`, `backups`, …), recursively.
    pub(crate) async fn list(&self, folder: &str) -> Result<Vec<Listed>> {
        self.bounded(|| format!("listing {folder}/"), async {
            let mut out = Vec::new();
            let mut s = self.store.list(Some(&self.path(folder)));
            while let Some(m) = s.next().await {
                match m {
                    Ok(m) => out.push(listed(m)),
                    // A directory target without the folder yet.
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(self.err(format!("listing {folder}/"), e)),
                }
            }
            Ok(out)
        })
        .await
    }

    pub(crate) fn chunk_path(&self, hash: &str) -> Path {
        self.path(&format!("chunks/{}/{hash}", &hash[..2]))
    }

    pub(crate) fn manifest_path(&self, id: uuid::Uuid) -> Path {
        self.path(&format!("backups/{id}.json"))
    }

    pub(crate) fn tombstone_path(&self, id: uuid::Uuid) -> Path {
        self.path(&format!("deleted/{id}.json"))
    }

    pub(crate) fn lease_path(&self, id: uuid::Uuid) -> Path {
        self.path(&format!("leases/{id}.json"))
    }
}

/// What the target holds of a chunk ([`Target::holds_chunk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holding {
    /// Its bytes, as far as the target lets them be checked.
    Intact,
    /// Nothing.
    Missing,
    /// Other bytes, or another length.
    Damaged,
}

fn md5_hex(data: &[u8]) -> String {
    use md5::Digest;
    md5::Md5::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn listed(m: ObjectMeta) -> Listed {
    let lm = &m.last_modified;
    let nanos =
        i128::from(lm.timestamp()) * 1_000_000_000 + i128::from(lm.timestamp_subsec_nanos());
    Listed {
        name: m.location.filename().unwrap_or_default().to_string(),
        size: m.size,
        last_modified: OffsetDateTime::from_unix_timestamp_nanos(nanos)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH),
        e_tag: m.e_tag,
        path: m.location,
    }
}

/// rustls has no crypto built in here (ring is picked over the aws-lc-rs
/// default, a large C build); it must be named once per process. Another
/// part of the process may have named one already: that one stays.
// rustls 0.23.48 deprecates ring's provider for its lack of post-quantum
// key exchange; the TLS it does (classical ECDHE) is still sound.
#[allow(deprecated)]
fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
