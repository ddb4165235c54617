//! Another build of the same code, installed as a package upgrade installs
//! it: a copy of the binary whose build mark (`blockplane_system::build`,
//! the commit it says it was built from) is rewritten, put in place by a
//! rename over the old file, so that processes still running the old one
//! see it deleted.

use std::os::unix::fs::FileExt;
use std::path::Path;

use blockplane_system::build::{MARK_LEN, mark_span, of_file};

/// Copies `src` to `dst` (mode kept), with build mark `mark` if given;
/// returns the copy's build.
pub fn copy_as_build(src: &Path, dst: &Path, mark: Option<&str>) -> String {
    std::fs::copy(src, dst)
        .unwrap_or_else(|e| panic!("copy {} to {}: {e}", src.display(), dst.display()));
    if let Some(mark) = mark {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dst)
            .unwrap();
        let span = mark_span(&f)
            .unwrap()
            .unwrap_or_else(|| panic!("{} has no build mark", src.display()));
        assert_eq!(span.size, MARK_LEN as u64, "the mark's section");
        let mut bytes = mark.as_bytes().to_vec();
        assert!(bytes.len() < MARK_LEN, "mark '{mark}' too long");
        bytes.resize(MARK_LEN, 0);
        f.write_all_at(&bytes, span.offset).unwrap();
    }
    of_file(dst).unwrap()
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
