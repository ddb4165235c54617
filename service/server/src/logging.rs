//! Log output of every blockplane process but the worker (which logs to its
//! run dir): human lines with control characters escaped, or JSON.

use std::io;

use serde::Deserialize;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

/// Sets up `tracing` output.
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BLOCKPLANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tower_http=info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&io::stderr()));
    let _ = match format {
        LogFormat::Human => builder.with_writer(|| EscapedLine(Vec::new())).try_init(),
        // JSON strings escape their control characters already.
        LogFormat::Json => builder.json().with_writer(io::stderr).try_init(),
    };
}

/// One human-format log line, written to stderr when dropped with the line
/// breaks and other control characters inside it escaped: a logged value (a
/// path with a newline, say) can never start a line of its own.
struct EscapedLine(Vec<u8>);

impl io::Write for EscapedLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for EscapedLine {
    fn drop(&mut self) {
        let line = escape_controls(&self.0);
        let _ = io::Write::write_all(&mut io::stderr().lock(), &line);
    }
}

/// Escapes control bytes but the final newline, tabs and (for colors) ESC.
fn escape_controls(line: &[u8]) -> Vec<u8> {
    let (body, end) = match line.strip_suffix(b"\n") {
        Some(body) => (body, &b"\n"[..]),
        None => (line, &b""[..]),
    };
    let mut out = Vec::with_capacity(line.len());
    for &b in body {
        match b {
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' | 0x1b => out.push(b),
            0..0x20 | 0x7f => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
            _ => out.push(b),
        }
    }
    out.extend_from_slice(end);
    out
}
