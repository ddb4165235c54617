//! `volume rm` without --force: a volume in use is deleted only when the
//! person at the terminal types its name; otherwise refused, saying why.

use std::io::IsTerminal;
use std::process::ExitCode;

use blockplane_client::Client;

use super::output::fail;

/// Passes when `volume` is idle, or its name is typed at the terminal.
pub async fn refuse_if_busy(client: &Client, volume: &str) -> Result<(), ExitCode> {
    let usage = client.volume_usage(volume).await.map_err(|e| fail(&e))?;
    if !usage.busy {
        return Ok(());
    }
    let name = &usage.name;
    let why = usage.reasons.join("; ");
    if std::io::stdin().is_terminal() {
        eprint!("volume '{name}' is in use: {why}.\nType its name to delete it anyway: ");
        let mut typed = String::new();
        let _ = std::io::stdin().read_line(&mut typed);
        if typed.trim() == name {
            return Ok(());
        }
        eprintln!("blockplane: volume '{name}' not deleted (the name was not typed)");
    } else {
        eprintln!(
            "blockplane: volume '{name}' is in use: {why}; not deleted (give --force to delete it anyway)"
        );
    }
    Err(ExitCode::FAILURE)
}
