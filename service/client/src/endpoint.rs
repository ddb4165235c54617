//! Where the API is: a unix socket or a TCP address.

use std::path::PathBuf;

use super::error::Error;

/// Where the API is.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// The service's unix socket.
    Unix(PathBuf),
    /// `host:port`.
    Tcp(String),
}

impl Endpoint {
    /// Parses `unix:/path`, `http://host:port` or `host:port`.
    pub fn parse(s: &str) -> Result<Self, Error> {
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
        if hostport.contains(':') && !hostport.contains('/') {
            Ok(Endpoint::Tcp(hostport.to_string()))
        } else {
            Err(Error::Endpoint(s.to_string()))
        }
    }
}
