//! Which build of blockplane an executable file is: the crate version plus
//! a build identity that differs between two builds of different code.
//!
//! The identity is read from the file, not compiled into this crate, so the
//! same code answers for the running process (`/proc/self/exe`, which stays
//! the file it started from even after a package replaced its path) and for
//! the file at a path now. It joins two parts:
//!
//! - the build mark: the git commit the binary was built from, which the
//!   `blockplane` crate's build script writes into a section of its own,
//!   [`MARK_SECTION`] ([`MARK_LEN`] bytes, NUL-padded text); empty outside a
//!   checkout (a container build);
//! - the linker's GNU build-id note, a hash of the linked code (Debian's
//!   and most toolchains link with `--build-id`), so two builds of one
//!   commit with different changes differ too.
//!
//! A file with neither has a hash of its whole contents instead.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::OnceLock;

/// The ELF section of the build mark.
pub const MARK_SECTION: &str = ".blockplane_build";

/// Bytes of the build mark: its text, then NULs.
pub const MARK_LEN: usize = 64;

/// The version of this workspace's crates.
pub const CRATE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// This process's build: `<crate version>+<identity>`, read once from
/// `/proc/self/exe`.
pub fn current() -> &'static str {
    static CURRENT: OnceLock<String> = OnceLock::new();
    CURRENT.get_or_init(|| match of_file(Path::new("/proc/self/exe")) {
        Ok(v) => v,
        Err(e) => format!("{CRATE_VERSION}+unreadable-{}", e.kind()),
    })
}

/// The build of the executable at `path`: `<crate version>+<identity>`.
pub fn of_file(path: &Path) -> io::Result<String> {
    let file = File::open(path)?;
    Ok(format!("{CRATE_VERSION}+{}", identity(&file)?))
}

/// The identity part of a build (see the module's documentation).
fn identity(file: &File) -> io::Result<String> {
    let elf = Elf::read(file)?;
    let mark = elf
        .section(file, MARK_SECTION)?
        .map(|bytes| mark_text(&bytes))
        .filter(|m| !m.is_empty());
    let build_id = elf.build_id(file)?.map(|(_, id)| hex(&id));
    Ok(match (mark, build_id) {
        (Some(m), Some(id)) => format!("{m}.{}", &id[..id.len().min(12)]),
        (Some(m), None) => m,
        (None, Some(id)) => id[..id.len().min(12)].to_string(),
        (None, None) => format!("fnv-{:016x}", fnv1a(file)?),
    })
}

/// The mark's text: up to its first NUL, printable ASCII only.
fn mark_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    let text = &bytes[..end];
    if text.iter().all(|b| b.is_ascii_graphic()) {
        String::from_utf8_lossy(text).into_owned()
    } else {
        String::new()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a over the whole file: the identity of a file that carries none.
fn fnv1a(file: &File) -> io::Result<u64> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0;
    loop {
        let n = file.read_at(&mut buf, at)?;
        if n == 0 {
            return Ok(hash);
        }
        for b in &buf[..n] {
            hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        at += n as u64;
    }
}

/// Where a section lies in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Its offset in the file.
    pub offset: u64,
    /// Its size, bytes.
    pub size: u64,
}

/// Where the build mark lies in the executable `file`, if it has one: what
/// a test rewrites in a copy to make "another build" of the same code.
pub fn mark_span(file: &File) -> io::Result<Option<Span>> {
    let elf = Elf::read(file)?;
    Ok(elf.find(file, MARK_SECTION)?.map(|s| Span {
        offset: s.offset,
        size: s.size,
    }))
}

/// The headers of a 64-bit little-endian ELF file this code needs.
struct Elf {
    /// `(offset, size)` of each PT_NOTE segment.
    notes: Vec<(u64, u64)>,
    /// Section headers: `(name offset, offset, size)`.
    sections: Vec<(u32, u64, u64)>,
    /// The section name table's `(offset, size)`.
    names: Option<(u64, u64)>,
}

fn bad(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("not an executable blockplane reads: {what}"),
    )
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads `len` bytes at `offset` (at most 64 MiB: headers and notes only).
fn read_span(file: &File, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    if len > 64 << 20 {
        return Err(bad("a header larger than 64 MiB"));
    }
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}

impl Elf {
    fn read(file: &File) -> io::Result<Self> {
        let mut h = [0u8; 64];
        let n = file.read_at(&mut h, 0)?;
        if n < 64 || &h[..4] != b"\x7fELF" || h[4] != 2 || h[5] != 1 {
            return Err(bad("no 64-bit little-endian ELF header"));
        }
        let (phoff, phentsize, phnum) = (u64_at(&h, 0x20), u16_at(&h, 0x36), u16_at(&h, 0x38));
        let (shoff, shentsize, shnum, shstrndx) = (
            u64_at(&h, 0x28),
            u16_at(&h, 0x3a),
            u16_at(&h, 0x3c),
            u16_at(&h, 0x3e),
        );
        let ph = read_span(file, phoff, u64::from(phentsize) * u64::from(phnum))?;
        let notes = ph
            .chunks_exact(usize::from(phentsize).max(1))
            .filter(|p| p.len() >= 0x28 && u32_at(p, 0) == 4) // PT_NOTE
            .map(|p| (u64_at(p, 8), u64_at(p, 0x20)))
            .collect();
        let sh = read_span(file, shoff, u64::from(shentsize) * u64::from(shnum))?;
        let sections: Vec<(u32, u64, u64)> = sh
            .chunks_exact(usize::from(shentsize).max(1))
            .filter(|s| s.len() >= 0x28)
            .map(|s| (u32_at(s, 0), u64_at(s, 0x18), u64_at(s, 0x20)))
            .collect();
        let names = sections
            .get(usize::from(shstrndx))
            .map(|(_, off, size)| (*off, *size));
        Ok(Self {
            notes,
            sections,
            names,
        })
    }

    /// The section called `name`.
    fn find(&self, file: &File, name: &str) -> io::Result<Option<Span>> {
        let Some((off, size)) = self.names else {
            return Ok(None);
        };
        let names = read_span(file, off, size)?;
        Ok(self.sections.iter().find_map(|(n, offset, size)| {
            let start = *n as usize;
            let rest = names.get(start..)?;
            let end = rest.iter().position(|b| *b == 0)?;
            (&rest[..end] == name.as_bytes()).then_some(Span {
                offset: *offset,
                size: *size,
            })
        }))
    }

    /// The contents of the section called `name`.
    fn section(&self, file: &File, name: &str) -> io::Result<Option<Vec<u8>>> {
        match self.find(file, name)? {
            Some(s) => read_span(file, s.offset, s.size).map(Some),
            None => Ok(None),
        }
    }

    /// The GNU build-id note: where its bytes are in the file, and them.
    fn build_id(&self, file: &File) -> io::Result<Option<(u64, Vec<u8>)>> {
        for (offset, size) in &self.notes {
            let notes = read_span(file, *offset, *size)?;
            let mut at = 0;
            while at + 12 <= notes.len() {
                let (namesz, descsz, kind) = (
                    u32_at(&notes, at) as usize,
                    u32_at(&notes, at + 4) as usize,
                    u32_at(&notes, at + 8),
                );
                let name_at = at + 12;
                let desc_at = name_at + namesz.next_multiple_of(4);
                let next = desc_at + descsz.next_multiple_of(4);
                if next > notes.len() {
                    break;
                }
                // NT_GNU_BUILD_ID, owner "GNU\0".
                if kind == 3 && &notes[name_at..name_at + namesz] == b"GNU\0" {
                    let id = notes[desc_at..desc_at + descsz].to_vec();
                    return Ok(Some((offset + desc_at as u64, id)));
                }
                at = next;
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_executable_has_a_build_and_it_is_stable() {
        let a = current();
        assert!(a.starts_with(&format!("{CRATE_VERSION}+")), "{a}");
        assert_eq!(of_file(Path::new("/proc/self/exe")).unwrap(), a);
    }

    /// A copy whose build-id note differs is another build; the test binary
    /// carries no mark, so the note is all there is of its identity.
    #[test]
    fn another_build_id_is_another_build() {
        let me = File::open("/proc/self/exe").unwrap();
        let elf = Elf::read(&me).unwrap();
        let Some((at, id)) = elf.build_id(&me).unwrap() else {
            // A toolchain without build-ids: the whole file's hash decides.
            assert!(current().contains("+fnv-"), "{}", current());
            return;
        };
        assert!(current().ends_with(&hex(&id)[..12]), "{}", current());
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("copy");
        std::fs::copy("/proc/self/exe", &copy).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
        f.write_all_at(&[!id[0]], at).unwrap();
        let other = of_file(&copy).unwrap();
        assert_ne!(other, current());
        assert!(mark_span(&File::open(&copy).unwrap()).unwrap().is_none());
    }

    #[test]
    fn a_mark_is_its_text_up_to_the_first_nul() {
        assert_eq!(mark_text(b"31e290d1a2b3\0\0\0"), "31e290d1a2b3");
        assert_eq!(mark_text(b"\0\0"), "");
        assert_eq!(mark_text(b"bad\xffmark\0"), "");
    }

    #[test]
    fn a_file_that_is_no_elf_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("script");
        std::fs::write(&p, b"#!/bin/sh\nexit 0\n").unwrap();
        let e = of_file(&p).unwrap_err();
        assert!(e.to_string().contains("ELF"), "{e}");
    }
}
