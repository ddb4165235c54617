//! Another build of the same code, installed as a package upgrade installs
//! it: a copy of the binary whose build mark (`blockplane_system::build`,
//! the commit it says it was built from) is rewritten, put in place by a
//! rename over the old file, so that processes still running the old one
//! see it deleted.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use blockplane_system::build::{MARK_LEN, mark_span, of_file};

/// Copies `src` to `dst` (mode kept), with build mark `mark` if given;
/// returns the copy's build.
///
/// The copy is written by child processes (`cp`, `dd`), never through a
/// descriptor of this one: a test thread that forks while this process
/// holds the copy open for writing would carry that descriptor until its
/// child execs, and an exec of the copy meanwhile fails with "Text file
/// busy" (`ETXTBSY`).
pub fn copy_as_build(src: &Path, dst: &Path, mark: Option<&str>) -> String {
    run(
        Command::new("cp")
            .arg("--preserve=mode")
            .arg("--")
            .arg(src)
            .arg(dst),
        None,
    );
    if let Some(mark) = mark {
        let f = std::fs::File::open(dst).unwrap();
        let span = mark_span(&f)
            .unwrap()
            .unwrap_or_else(|| panic!("{} has no build mark", src.display()));
        assert_eq!(span.size, MARK_LEN as u64, "the mark's section");
        let mut bytes = mark.as_bytes().to_vec();
        assert!(bytes.len() < MARK_LEN, "mark '{mark}' too long");
        bytes.resize(MARK_LEN, 0);
        let mut of = std::ffi::OsString::from("of=");
        of.push(dst);
        run(
            Command::new("dd")
                .arg(of)
                .args(["bs=1", "conv=notrunc", "status=none"])
                .arg(format!("seek={}", span.offset))
                .arg(format!("count={MARK_LEN}")),
            Some(&bytes),
        );
    }
    of_file(dst).unwrap()
}

/// Runs `c` to success, `input` on its stdin.
fn run(c: &mut Command, input: Option<&[u8]>) {
    c.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = c.spawn().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    if let Some(input) = input {
        child.stdin.take().unwrap().write_all(input).unwrap();
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "{c:?}: {status}");
}

/// Installs `new` at `path` by renaming it over whatever is there.
pub fn install(new: &Path, path: &Path) {
    std::fs::rename(new, path)
        .unwrap_or_else(|e| panic!("install {} at {}: {e}", new.display(), path.display()));
}

/// The executable process `pid` runs, as the kernel names it (`(deleted)`
/// after a rename over its file).
pub fn exe_of(pid: u64) -> String {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}
