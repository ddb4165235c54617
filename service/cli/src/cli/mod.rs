//! The `blockplane` command line: `serve` runs the service; every other
//! command is a client of its API (tables for people, `--json` for scripts,
//! a non-zero exit with the API's message on error).
//!
//! [`args`] defines the commands and [`local`] runs those that are no client
//! of the API. [`commands`] runs the others with the typed client and
//! [`render`] prints their answers ([`table`] lays them out, [`names`] puts
//! names in place of ids); `volume rm` checks for use first ([`busy`]),
//! allocates and copies are waited for ([`progress`]), and `events --follow`
//! ([`events`]) and `volume top` ([`top`]) run until interrupted,
//! `upgrade` hands volumes over one at a time ([`upgrade`]); all of them
//! print and fail through [`output`].

mod args;
mod busy;
mod commands;
mod events;
mod local;
mod names;
mod output;
mod progress;
mod render;
mod table;
mod top;
mod upgrade;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};

use args::{CLIENT_FLAGS, Cli, Command};

/// The spec of `worker --spec JSON`, exactly as the service starts a worker.
/// A worker's start is on a recovering volume's path (a pod kill starts one
/// per volume at once), and building the whole command line's parser was
/// about a tenth of a worker's main thread there; any other form goes
/// through the parser.
fn worker_spec(mut args: impl Iterator<Item = std::ffi::OsString>) -> Option<String> {
    let (Some(sub), Some(flag), Some(spec), None) =
        (args.next(), args.next(), args.next(), args.next())
    else {
        return None;
    };
    (sub == "worker" && flag == "--spec")
        .then(|| spec.into_string().ok())
        .flatten()
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    if let Some(spec) = worker_spec(std::env::args_os().skip(1)) {
        return blockplane_worker::main(&spec);
    }
    // Before the command the client flags are plain ones: global there, they
    // would reach `serve` and the other commands that are no API client.
    let mut cmd = Cli::command();
    for id in CLIENT_FLAGS {
        cmd = cmd.mut_arg(id, |a| a.global(false));
    }
    let matches = cmd.get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // `backup FILE` copies the registry itself; `backup ls` and the others
    // are clients.
    let local = match matches.subcommand() {
        Some(("backup", m)) => m.subcommand().is_none().then_some("backup"),
        Some((sub @ ("serve" | "worker" | "openapi"), _)) => Some(sub),
        _ => None,
    };
    if let Some(sub) = local
        && let Some(flag) = CLIENT_FLAGS
            .iter()
            .find(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
    {
        eprintln!(
            "blockplane: --{flag} is a flag of the API's clients; `{sub}` does not take it (see blockplane {sub} --help)"
        );
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Serve(args) => local::serve(args),
        Command::Worker { spec } => blockplane_worker::main(&spec),
        Command::Csi {
            args,
            log_format,
            api,
        } => local::csi(args, log_format, api.or(&cli.client.api)),
        Command::Backup {
            data_dir,
            file: Some(file),
            cmd: None,
        } => local::backup(data_dir, &file),
        Command::Dashboard { listen, api } => {
            let a = api.or(&cli.client.api);
            match a.token() {
                Ok(token) => local::dashboard(a.api.as_deref(), token, &listen),
                Err(e) => {
                    eprintln!("blockplane: {e}");
                    std::process::ExitCode::from(2)
                }
            }
        }
        Command::Openapi => {
            let _ = std::io::Write::write_all(
                &mut std::io::stdout(),
                blockplane_server::openapi_json().as_bytes(),
            );
            ExitCode::SUCCESS
        }
        _ => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(commands::run(cli))
        }
    }
}

#[cfg(test)]
mod tests {
    /// The names the client puts in paths reach the API as one segment each.
    #[test]
    fn path_segments_are_encoded() {
        use blockplane_client::encode_segment;
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
        assert_eq!(encode_segment("vol-1.x_y"), "vol-1.x_y");
    }

    fn args(a: &[&str]) -> impl Iterator<Item = std::ffi::OsString> {
        a.iter()
            .map(std::ffi::OsString::from)
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn only_the_services_own_worker_command_skips_the_parser() {
        use super::worker_spec;
        assert_eq!(
            worker_spec(args(&["worker", "--spec", "{}"])),
            Some("{}".into())
        );
        assert_eq!(worker_spec(args(&["worker", "--help"])), None);
        assert_eq!(worker_spec(args(&["worker", "--spec={}"])), None);
        assert_eq!(worker_spec(args(&["worker", "--spec", "{}", "x"])), None);
        assert_eq!(worker_spec(args(&["serve", "--spec", "{}"])), None);
    }
}
