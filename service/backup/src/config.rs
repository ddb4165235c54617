//! Where backups go: `--backup-target` parsed into a [`TargetConfig`], and
//! the S3 credentials it needs.

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The region an S3 target uses when its specification names none.
pub const DEFAULT_REGION: &str = "us-east-1";

/// Where backups are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetConfig {
    /// A local directory (or NFS mount); must exist.
    Dir {
        /// The directory, absolute.
        path: PathBuf,
    },
    /// S3-compatible storage.
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix under which everything is stored, without leading
        /// or trailing `/`; empty for the bucket's root.
        prefix: String,
        /// The endpoint URL (`http://` or `https://`), for storage other than AWS.
        endpoint: Option<String>,
        /// The region.
        region: String,
        /// The keys requests are signed with.
        credentials: Credentials,
    },
}

/// S3 access keys. Their `Debug` shows the key id only.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The access key id (not secret; shown in `Debug`).
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// A session token, for temporary credentials.
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl TargetConfig {
    /// Parses `--backup-target`: an absolute path or `file:///abs/path` → Dir;
    /// `s3://bucket[/prefix]` → S3, with optional query
    /// `?endpoint=http://127.0.0.1:9000&region=us-east-1` (region default
    /// "us-east-1"; an http:// endpoint is allowed, for loopback and test
    /// servers).
    ///
    /// S3 credentials come from `credentials_file` when given (lines
    /// `access_key_id = ...`, `secret_access_key = ...`, optional
    /// `session_token = ...`; `#` starts a comment; the file must not be
    /// readable by everyone), else from the environment: `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`. Missing credentials for
    /// S3 are an [`Error::Config`] naming what to set. A directory target
    /// needs none and ignores the file.
    pub fn parse(spec: &str, credentials_file: Option<&Path>) -> Result<TargetConfig> {
        parse_with_env(spec, credentials_file, |name| std::env::var(name).ok())
    }

    /// Where it is, for logs, events and the API: `dir:/path` or
    /// `s3://bucket/prefix (endpoint …, region …)`; never credentials.
    pub fn describe(&self) -> String {
        match self {
            TargetConfig::Dir { path } => format!("dir:{}", path.display()),
            TargetConfig::S3 {
                bucket,
                prefix,
                endpoint,
                region,
                ..
            } => {
                let mut s = format!("s3://{bucket}");
                if !prefix.is_empty() {
                    s.push('/');
                    s.push_str(prefix);
                }
                match endpoint {
                    Some(e) => s.push_str(&format!(" (endpoint {e}, region {region})")),
                    None => s.push_str(&format!(" (region {region})")),
                }
                s
            }
        }
    }
}

const FORMS: &str =
    "an absolute path, file:///absolute/path or s3://bucket[/prefix][?endpoint=URL&region=REGION]";

/// [`TargetConfig::parse`] with the environment as a function, so tests
/// need not change the process's.
pub(crate) fn parse_with_env(
    spec: &str,
    credentials_file: Option<&Path>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<TargetConfig> {
    let spec = spec.trim();
    if spec.starts_with('/') {
        return dir(PathBuf::from(spec), spec);
    }
    if let Some(rest) = spec.strip_prefix("file://") {
        if !rest.starts_with('/') {
            return Err(Error::Config(format!(
                "'{spec}' is not a local file URL: write file:///absolute/path (three slashes, no host)"
            )));
        }
        let decoded = percent_encoding::percent_decode_str(rest)
            .decode_utf8()
            .map_err(|_| Error::Config(format!("'{spec}': the path is not UTF-8 once decoded")))?;
        return dir(PathBuf::from(decoded.as_ref()), spec);
    }
    if let Some(rest) = spec.strip_prefix("s3://") {
        return s3(spec, rest, credentials_file, env);
    }
    Err(Error::Config(format!(
        "'{spec}' is not a backup target: give {FORMS}"
    )))
}

fn dir(path: PathBuf, spec: &str) -> Result<TargetConfig> {
    if path
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(Error::Config(format!(
            "'{spec}' contains '..'; write the directory's path without parent references"
        )));
    }
    Ok(TargetConfig::Dir { path })
}

fn s3(
    spec: &str,
    rest: &str,
    credentials_file: Option<&Path>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<TargetConfig> {
    let (location, query) = match rest.split_once('?') {
        Some((l, q)) => (l, Some(q)),
        None => (rest, None),
    };
    let (bucket, prefix) = match location.split_once('/') {
        Some((b, p)) => (b, p.trim_matches('/')),
        None => (location, ""),
    };
    if !valid_bucket(bucket) {
        return Err(Error::Config(format!(
            "'{spec}': '{bucket}' is not a bucket name (3 to 63 of a-z, 0-9, '.', '-', starting and ending with a letter or digit)"
        )));
    }
    if !prefix.is_empty()
        && prefix
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        return Err(Error::Config(format!(
            "'{spec}': the prefix '{prefix}' has an empty, '.' or '..' segment"
        )));
    }
    let mut endpoint = None;
    let mut region = None;
    for pair in query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|p| !p.is_empty())
    {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_encoding::percent_decode_str(value)
            .decode_utf8()
            .map_err(|_| Error::Config(format!("'{spec}': the value of '{key}' is not UTF-8")))?
            .into_owned();
        match key {
            "endpoint" => endpoint = Some(check_endpoint(spec, value)?),
            "region" if !value.is_empty() => region = Some(value),
            "region" => return Err(Error::Config(format!("'{spec}': region is empty"))),
            _ => {
                return Err(Error::Config(format!(
                    "'{spec}': unknown option '{key}'; an s3 target takes endpoint= and region="
                )));
            }
        }
    }
    let credentials = match credentials_file {
        Some(file) => read_credentials_file(file)?,
        None => credentials_from_env(env)?,
    };
    Ok(TargetConfig::S3 {
        bucket: bucket.to_string(),
        prefix: prefix.to_string(),
        endpoint,
        region: region.unwrap_or_else(|| DEFAULT_REGION.to_string()),
        credentials,
    })
}

fn valid_bucket(b: &str) -> bool {
    let edge = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    (3..=63).contains(&b.len())
        && b.bytes().all(|c| edge(c) || c == b'.' || c == b'-')
        && edge(b.as_bytes()[0])
        && edge(b.as_bytes()[b.len() - 1])
}

fn check_endpoint(spec: &str, e: String) -> Result<String> {
    let after_scheme = e
        .strip_prefix("http://")
        .or_else(|| e.strip_prefix("https://"));
    let Some(after) = after_scheme else {
        return Err(Error::Config(format!(
            "'{spec}': the endpoint must be an http:// or https:// URL"
        )));
    };
    let authority = after.split('/').next().unwrap_or("");
    if authority.is_empty() {
        return Err(Error::Config(format!("'{spec}': the endpoint has no host")));
    }
    // A user:password@ part would put a secret into every description of
    // the target.
    if authority.contains('@') {
        return Err(Error::Config(
            "the endpoint contains user information ('@'); give credentials in the credentials file or the environment, never in the URL".to_string(),
        ));
    }
    Ok(e.trim_end_matches('/').to_string())
}

fn credentials_from_env(env: impl Fn(&str) -> Option<String>) -> Result<Credentials> {
    let get = |n: &str| env(n).filter(|v| !v.is_empty());
    match (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY")) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Credentials {
            access_key_id,
            secret_access_key,
            session_token: get("AWS_SESSION_TOKEN"),
        }),
        (id, _) => Err(Error::Config(format!(
            "an s3 target needs credentials: set {} in the environment, or give a credentials file (access_key_id = ..., secret_access_key = ...)",
            if id.is_some() {
                "AWS_SECRET_ACCESS_KEY"
            } else {
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            }
        ))),
    }
}

fn read_credentials_file(file: &Path) -> Result<Credentials> {
    let shown = file.display();
    let meta = std::fs::metadata(file)
        .map_err(|e| Error::Config(format!("credentials file {shown}: {e}")))?;
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(Error::Config(format!(
            "credentials file {shown} is open to other users (mode {:04o}); make it the service user's only first: chmod 600 {shown}",
            mode & 0o7777
        )));
    }
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::Config(format!("credentials file {shown}: {e}")))?;
    let (mut id, mut secret, mut token) = (None, None, None);
    for (n, line) in text.lines().enumerate() {
        // A comment is a whole line: a `#` inside a secret is the secret's.
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // Values are never quoted in a message: a malformed line may hold a secret.
        let Some((key, value)) = line.split_once('=') else {
            return Err(Error::Config(format!(
                "credentials file {shown}, line {}: expected 'key = value'",
                n + 1
            )));
        };
        let value = Some(value.trim().to_string()).filter(|v| !v.is_empty());
        match key.trim() {
            "access_key_id" | "aws_access_key_id" => id = value,
            "secret_access_key" | "aws_secret_access_key" => secret = value,
            "session_token" | "aws_session_token" => token = value,
            // The key is not quoted either: `SECRET=` pasted alone would be
            // shown.
            _ => {
                return Err(Error::Config(format!(
                    "credentials file {shown}, line {}: unknown key (known: access_key_id, secret_access_key, session_token)",
                    n + 1
                )));
            }
        }
    }
    match (id, secret) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Credentials {
            access_key_id,
            secret_access_key,
            session_token: token,
        }),
        (id, _) => Err(Error::Config(format!(
            "credentials file {shown} lacks {}",
            if id.is_some() {
                "secret_access_key"
            } else {
                "access_key_id"
            }
        ))),
    }
}
