//! The one `blockplane` executable: the service, its workers, the CSI
//! driver, the dashboard's port-forward and the CLI ([`cli`]).

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
