//! The commands that are no client of the API: the service, the CSI
//! driver, the dashboard's port-forward and the registry's backup.

use std::process::ExitCode;

use blockplane_client::Endpoint;
use blockplane_server::config::{ServeArgs, default_data_dir, default_socket};
use blockplane_server::logging::{self, LogFormat};
use blockplane_server::proxy::ProxyConfig;

use super::args::ApiArgs;

/// `blockplane serve`.
pub fn serve(args: ServeArgs) -> ExitCode {
    let cfg = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    logging::init(cfg.log_format);
    let rt = multi_thread_runtime();
    match rt.block_on(blockplane_server::serve(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "blockplane stopped");
            eprintln!("blockplane: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `blockplane backup`: SQLite's `VACUUM INTO`, a consistent snapshot even
/// while the service writes (it reads like any other reader of the WAL).
pub fn backup(data_dir: Option<std::path::PathBuf>, file: &std::path::Path) -> ExitCode {
    use std::os::unix::fs::OpenOptionsExt;
    let db = data_dir
        .unwrap_or_else(default_data_dir)
        .join("blockplane.db");
    if !db.is_file() {
        eprintln!("blockplane: no registry at {}", db.display());
        return ExitCode::FAILURE;
    }
    // Made here, empty, so the copy is private from its first byte and an
    // existing file is never replaced.
    if let Err(e) = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
    {
        eprintln!("blockplane: backup file {}: {e}", file.display());
        return ExitCode::FAILURE;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(blockplane_server::backup_registry(&db, file)) {
        Ok(()) => {
            println!("backed up {} to {}", db.display(), file.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = std::fs::remove_file(file);
            eprintln!("blockplane: backup of {}: {e}", db.display());
            ExitCode::FAILURE
        }
    }
}

/// `blockplane csi`.
pub fn csi(args: blockplane_csi::CsiArgs, log_format: LogFormat, api: ApiArgs) -> ExitCode {
    logging::init(log_format);
    let address = api_address(api.api.as_deref());
    let token = match api.token() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("blockplane csi: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = multi_thread_runtime();
    match rt.block_on(blockplane_csi::serve(args, &address, token)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "CSI driver stopped");
            eprintln!("blockplane csi: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The runtime for the long-running subcommands.
fn multi_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The API address given, or the local service's socket.
pub fn api_address(api: Option<&str>) -> String {
    api.map(str::to_string)
        .unwrap_or_else(|| format!("unix:{}", default_socket(&default_data_dir()).display()))
}

/// `blockplane dashboard`.
pub fn dashboard(api: Option<&str>, token: Option<String>, listen: &str) -> ExitCode {
    let api = api_address(api);
    let cfg = match Endpoint::parse(&api)
        .map_err(|e| e.to_string())
        .and_then(|up| ProxyConfig::new(listen, up, token).map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("blockplane: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = multi_thread_runtime();
    let ready = |addr: std::net::SocketAddr| {
        // One line on stdout, flushed, so that scripts can wait for it.
        let line = format!("dashboard at http://{addr}/ (API {api})\n");
        let mut out = std::io::stdout();
        let _ = std::io::Write::write_all(&mut out, line.as_bytes());
        let _ = std::io::Write::flush(&mut out);
    };
    match rt.block_on(blockplane_server::proxy::run(cfg, ready)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blockplane: {e}");
            ExitCode::FAILURE
        }
    }
}
