//! Writes the build mark (`blockplane_system::build`): the git commit this
//! binary is built from, when it is built from a checkout. Outside one (a
//! container build, a source tarball) or without git it writes an empty
//! mark, quickly and without failing: the linker's build-id then tells
//! builds apart. `BLOCKPLANE_BUILD_COMMIT` overrides what git says.

use std::path::{Path, PathBuf};
use std::process::Command;

/// As `blockplane_system::build::MARK_LEN`.
const MARK_LEN: usize = 64;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    out.status.success().then(|| text.trim().to_string())
}

/// The commit of the checkout holding `dir`; rebuilt when HEAD moves.
fn commit(dir: &Path) -> Option<String> {
    let commit = git(dir, &["rev-parse", "--short=12", "HEAD"])?;
    let head = git(dir, &["symbolic-ref", "-q", "HEAD"]);
    let watched = ["HEAD", "packed-refs"]
        .into_iter()
        .map(str::to_string)
        .chain(head);
    for name in watched {
        if let Some(path) = git(dir, &["rev-parse", "--git-path", &name]) {
            let path = dir.join(path);
            // A path that does not exist would rerun this script every build.
            if path.exists() {
                println!("cargo::rerun-if-changed={}", path.display());
            }
        }
    }
    Some(commit)
}

fn main() {
    println!("cargo::rerun-if-env-changed=BLOCKPLANE_BUILD_COMMIT");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let mark = std::env::var("BLOCKPLANE_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| commit(&dir))
        .unwrap_or_default();
    let mut bytes: Vec<u8> = mark
        .bytes()
        .filter(u8::is_ascii_graphic)
        .take(MARK_LEN - 1)
        .collect();
    bytes.resize(MARK_LEN, 0);
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it")).join("mark.rs");
    std::fs::write(
        out,
        format!(
            "[{}]",
            bytes
                .iter()
                .map(u8::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
    .expect("write the build mark");
}
