//! Why a call of the API failed: the API's own error answer, or a failure to
//! talk to it at all.

use hyper::StatusCode;

use blockplane_api::model::{ErrorBody, ErrorCode};

/// A failed call of the API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API answered with an error: its status, stable code and message.
    #[error("{message} ({code}, HTTP {})", status.as_u16())]
    Refused {
        /// The request, as `METHOD path`.
        request: String,
        /// The answer's status.
        status: StatusCode,
        /// The answer's stable code.
        code: ErrorCode,
        /// The answer's message, naming the object and the rule.
        message: String,
    },
    /// The address is not one the client can reach.
    #[error("invalid API address '{0}': use unix:/path.sock or http://host:port")]
    Endpoint(String),
    /// No connection to the API.
    #[error("cannot connect to the blockplane API at {endpoint}: {source}")]
    Connect {
        /// The address, as given.
        endpoint: String,
        /// Why the connection failed.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    /// The request could not be built.
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
    /// An answer whose body is not JSON.
    #[error("the API answered {status} with a body that is not JSON: {body}")]
    NotJson {
        /// The answer's status.
        status: StatusCode,
        /// The body, as text.
        body: String,
    },
    /// A JSON answer that is not what the operation answers.
    #[error("the API's answer to {request} ({status}) does not read as documented: {source}")]
    Unexpected {
        /// The request, as `METHOD path`.
        request: String,
        /// The answer's status.
        status: StatusCode,
        /// What did not match.
        #[source]
        source: serde_json::Error,
    },
}

impl Error {
    /// The error of a non-2xx answer to `request`.
    pub(crate) fn answer(request: String, status: StatusCode, body: &[u8]) -> Error {
        match serde_json::from_slice::<ErrorBody>(body) {
            Ok(ErrorBody { error }) => Error::Refused {
                request,
                status,
                code: error.code,
                message: error.message,
            },
            Err(source) if source.is_data() => Error::Unexpected {
                request,
                status,
                source,
            },
            Err(_) => Error::NotJson {
                status,
                body: String::from_utf8_lossy(body).into_owned(),
            },
        }
    }
}
