//! What a client command writes besides its answer's rendering: the answer
//! on stdout (a closed stdout is no error of ours) and a failed call on
//! stderr with its exit code. Every client command shares these.

use std::process::ExitCode;

use blockplane_client as client;
use hyper::StatusCode;

/// Prints why a call failed; the exit code of the failure.
pub fn fail(e: &client::Error) -> ExitCode {
    let hint = match e {
        client::Error::Refused {
            status: StatusCode::UNAUTHORIZED,
            ..
        } => "; give the API's token with --token or BLOCKPLANE_TOKEN",
        _ => "",
    };
    eprintln!("blockplane: {e}{hint}");
    ExitCode::FAILURE
}

/// Writes `text` to stdout; `false` once stdout is closed (`| head`), which
/// is no error of ours.
pub fn print(text: &str) -> bool {
    std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes()).is_ok()
}
