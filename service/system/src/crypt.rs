//! LUKS2 encryption of image files, through Debian's `cryptsetup` program.
//!
//! The header lives inside the image file, so a copy of the file stays
//! encrypted and opens with the same keys. Opening one maps the plaintext
//! through the kernel's dm-crypt over the volume's device, whatever backend
//! made that device.
//!
//! Why the program and not `libcryptsetup-rs`: `cryptsetup` is the same
//! library behind Debian's own command line, and calling it keeps
//! libcryptsetup (with its libdevmapper, json-c and crypto libraries) out of
//! the service binary, which must start on hosts that never encrypt.
//! Keys reach it only on a pipe (`--key-file=-`, or `/dev/fd/4` for a new
//! key): never in its arguments or environment, so never in
//! `/proc/PID/cmdline` or `/proc/PID/environ`. Images reach it as an open
//! descriptor (`/dev/fd/3`), so the path the caller opened under its image
//! roots is the file it works on.
//!
//! Whether a file is LUKS at all is read from its magic here, not asked of
//! the program: a host without cryptsetup still tells an encrypted file
//! from a plain one, and no failure of the program (a LUKS1 header, damaged
//! metadata, a program that cannot run) can make a LUKS file pass for
//! plain, whose volume would serve its ciphertext as data to write over.

use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The program, looked up on this `PATH` only.
const PROGRAM: &str = "cryptsetup";
const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the child finds the image, and a second key.
const IMAGE_FD: i32 = 3;
const NEW_KEY_FD: i32 = 4;

/// cryptsetup's exit status for "no key available with this passphrase".
const EXIT_NO_PERMISSION: i32 = 2;

/// The magic of a LUKS header at the start of the file (LUKS1 and LUKS2's
/// primary header): "LUKS" 0xba 0xbe, then the version, u16 big-endian.
const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";

/// The magic of LUKS2's secondary header: "SKUL" 0xba 0xbe.
const MAGIC_SECONDARY: &[u8; 6] = b"SKUL\xba\xbe";

/// Where LUKS2 puts its secondary header: right after the primary, whose
/// size (binary header and JSON area) is one of these, 16 KiB to 4 MiB
/// (the LUKS2 on-disk format; cryptsetup and blkid look at the same).
const SECONDARY_OFFSETS: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

/// The most bytes of a key: cryptsetup's own limit for a key read from a
/// file is 8 MiB; the API's is far lower.
pub const MAX_KEY_BYTES: usize = 1024;

/// What went wrong with an encrypted image.
#[derive(Debug, thiserror::Error)]
pub enum CryptError {
    /// The program could not be run.
    #[error("cannot run cryptsetup ({0}): install Debian's cryptsetup-bin")]
    Missing(#[source] io::Error),
    /// No key slot opens with the key given.
    #[error("no key slot opens with the key given")]
    WrongKey,
    /// cryptsetup refused or failed; its own message.
    #[error("cryptsetup {op}: {message}")]
    Failed {
        /// What was asked (`luksFormat`, `open`, ...).
        op: &'static str,
        /// Its standard error, trimmed.
        message: String,
    },
    /// Its answer could not be read.
    #[error("cryptsetup {op}: unexpected output: {message}")]
    Output {
        /// What was asked.
        op: &'static str,
        /// What was wrong with it.
        message: String,
    },
    /// The image's first bytes could not be read to look for a header.
    #[error("cannot read its first bytes to look for a LUKS header: {0}")]
    Read(#[source] io::Error),
    /// A LUKS header of a version other than 2 (LUKS1, or one this build
    /// does not know).
    #[error("it has a {} header (its magic at byte {offset}), and only LUKS2 is opened here", version_name(*.version))]
    Unsupported {
        /// The header's version.
        version: u16,
        /// Where its magic is.
        offset: u64,
    },
    /// A LUKS2 magic whose header cryptsetup cannot read (both copies of its
    /// metadata damaged, say).
    #[error(
        "it has a LUKS2 header (its magic at byte {offset}) that cryptsetup cannot read: {message}"
    )]
    Unreadable {
        /// Where its magic is: 0 for the primary header, else the
        /// secondary's offset.
        offset: u64,
        /// cryptsetup's own words.
        message: String,
    },
}

/// `LUKS1`, `LUKS2`, or `LUKS version N` for one no release has.
pub fn version_name(version: u16) -> String {
    match version {
        1 | 2 => format!("LUKS{version}"),
        v => format!("LUKS version {v}"),
    }
}

/// What an image's first bytes say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Magic {
    /// No LUKS magic where LUKS puts one.
    Plain,
    /// A LUKS header.
    Luks {
        /// Its version (1, 2, ...), as its magic gives it.
        version: u16,
        /// Where its magic is: 0 for the primary header, else the offset of
        /// a LUKS2 secondary header (the primary's magic is gone).
        offset: u64,
    },
}

/// How hard a new key slot is to guess by trying: argon2id's cost, either
/// sized to a time here or given outright.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kdf {
    /// As costly as one unlock taking this many milliseconds on this host
    /// (cryptsetup's `--iter-time`): cryptsetup benchmarks argon2id before
    /// each new slot, so the cost follows the host and its load at the time.
    Timed {
        /// Milliseconds one unlock should take here.
        unlock_ms: u32,
    },
    /// A fixed cost, the same on every host and under any load, with no
    /// benchmark first: what a fleet whose volumes move between hosts, or a
    /// host that must not weaken keys made while it is busy, asks for.
    Fixed {
        /// argon2id's time cost (passes over its memory), at least
        /// [`Kdf::MIN_ITERATIONS`].
        iterations: u32,
        /// argon2id's memory, KiB, from [`Kdf::MIN_MEMORY_KIB`] to
        /// [`Kdf::MAX_MEMORY_KIB`].
        memory_kib: u32,
    },
}

impl Kdf {
    /// cryptsetup's least argon2id time cost.
    pub const MIN_ITERATIONS: u32 = 4;
    /// cryptsetup's least argon2id memory, KiB.
    pub const MIN_MEMORY_KIB: u32 = 32;
    /// cryptsetup's most argon2id memory, KiB (4 GiB).
    pub const MAX_MEMORY_KIB: u32 = 4 << 20;

    /// cryptsetup's arguments for a new key slot of this cost.
    fn args(self) -> Vec<String> {
        let mut args = vec!["--pbkdf".to_string(), "argon2id".to_string()];
        match self {
            Kdf::Timed { unlock_ms } => {
                args.extend(["--iter-time".to_string(), unlock_ms.to_string()]);
            }
            Kdf::Fixed {
                iterations,
                memory_kib,
            } => args.extend([
                "--pbkdf-force-iterations".to_string(),
                iterations.to_string(),
                "--pbkdf-memory".to_string(),
                memory_kib.to_string(),
            ]),
        }
        args
    }
}

/// The image's LUKS2 layout, from its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Where the encrypted payload starts in the file, bytes.
    pub payload_offset: u64,
    /// The cipher, e.g. `aes-xts-plain64`.
    pub cipher: String,
    /// The key slots in use, in order.
    pub key_slots: Vec<u32>,
}

/// One run of the program.
struct Run<'a> {
    op: &'static str,
    args: Vec<String>,
    image: Option<BorrowedFd<'a>>,
    key: Option<&'a [u8]>,
    new_key: Option<&'a [u8]>,
}

impl<'a> Run<'a> {
    fn new(op: &'static str) -> Self {
        Self {
            op,
            args: vec![op.to_string()],
            image: None,
            key: None,
            new_key: None,
        }
    }

    fn args(mut self, args: &[impl AsRef<str>]) -> Self {
        self.args
            .extend(args.iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// The image as `/dev/fd/3`, the last argument.
    fn image(mut self, image: BorrowedFd<'a>) -> Self {
        self.image = Some(image);
        self.args.push(format!("/dev/fd/{IMAGE_FD}"));
        self
    }

    /// The key on standard input.
    fn key(mut self, key: &'a [u8]) -> Self {
        self.key = Some(key);
        self.args.push("--key-file=-".into());
        self
    }

    fn new_key(mut self, key: &'a [u8]) -> Self {
        self.new_key = Some(key);
        self.args
            .push(format!("--new-keyfile=/dev/fd/{NEW_KEY_FD}"));
        self
    }

    /// Runs it: its standard output, or why not.
    fn output(self) -> Result<Vec<u8>, CryptError> {
        let op = self.op;
        let mut cmd = Command::new(PROGRAM);
        cmd.args(&self.args)
            .env_clear()
            .env("PATH", PATH)
            .env("LC_ALL", "C")
            .stdin(if self.key.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Above the target numbers, so each dup2 below moves a descriptor
        // (and so clears its close-on-exec) rather than meeting itself.
        let image = self
            .image
            .map(high_dup)
            .transpose()
            .map_err(CryptError::Missing)?;
        let new_key = self
            .new_key
            .map(key_pipe)
            .transpose()
            .map_err(CryptError::Missing)?;
        let moves: Vec<(i32, i32)> = [
            image.as_ref().map(|f| (f.as_raw_fd(), IMAGE_FD)),
            new_key.as_ref().map(|f| (f.as_raw_fd(), NEW_KEY_FD)),
        ]
        .into_iter()
        .flatten()
        .collect();
        // SAFETY: dup2 is async-signal-safe and touches only the child's
        // descriptor table.
        unsafe {
            cmd.pre_exec(move || {
                for &(from, to) in &moves {
                    if libc::dup2(from, to) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(CryptError::Missing)?;
        drop((image, new_key));
        if let (Some(key), Some(mut stdin)) = (self.key, child.stdin.take()) {
            // A key is far below a pipe's buffer: this never waits on the
            // child. A child that exited early is seen in its status below.
            let _ = stdin.write_all(key);
        }
        let out = child.wait_with_output().map_err(CryptError::Missing)?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        if out.status.code() == Some(EXIT_NO_PERMISSION) && self.key.is_some() {
            return Err(CryptError::WrongKey);
        }
        Err(CryptError::Failed {
            op,
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }

    fn run(self) -> Result<(), CryptError> {
        self.output().map(drop)
    }
}

/// A close-on-exec duplicate of `fd` numbered above the child's targets.
fn high_dup(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(fd, 10)?)
}

/// A pipe holding `key`, its write end closed: the read end, numbered above
/// the child's targets.
fn key_pipe(key: &[u8]) -> io::Result<OwnedFd> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    std::fs::File::from(write).write_all(key)?;
    high_dup(read.as_fd())
}

/// Formats `image` as LUKS2 with one key slot (slot 0) opened by `key`:
/// its header in the first `header_bytes` of the file (a multiple of 1 MiB;
/// LUKS2's default area is 16 MiB), the payload after it. Whatever the file
/// held is no longer readable.
pub fn format(
    image: BorrowedFd<'_>,
    key: &[u8],
    header_bytes: u64,
    kdf: Kdf,
) -> Result<(), CryptError> {
    Run::new("luksFormat")
        .args(&[
            "--type",
            "luks2",
            "--batch-mode",
            "--offset",
            &(header_bytes / 512).to_string(),
        ])
        .args(&kdf.args())
        .key(key)
        .image(image)
        .run()
}

/// What `image`'s magic says it is, read from the file itself (no
/// cryptsetup): a LUKS magic at 0, or LUKS2's secondary magic at one of its
/// offsets, whether or not the rest of the header can be read.
///
/// Read with `O_DIRECT` where the file's filesystem or device has it, so
/// that the look leaves no page of the image in the page cache (an
/// unwritten extent with cached pages reads as data to `SEEK_DATA`, and a
/// direct-mapped volume's image is to hold none); elsewhere buffered, the
/// pages read dropped after.
pub fn magic(image: BorrowedFd<'_>) -> Result<Magic, CryptError> {
    read_magic(HeadReader::open(image))
}

fn read_magic(mut reader: HeadReader<'_>) -> Result<Magic, CryptError> {
    let found = (|| {
        if let Some((m, version)) = reader.at(0)?
            && &m == MAGIC
        {
            return Ok(Magic::Luks { version, offset: 0 });
        }
        for offset in SECONDARY_OFFSETS {
            if let Some((m, version)) = reader.at(offset)?
                && &m == MAGIC_SECONDARY
            {
                return Ok(Magic::Luks { version, offset });
            }
        }
        Ok(Magic::Plain)
    })();
    reader.forget();
    found
}

/// One page, aligned as `O_DIRECT` wants its buffers.
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// Reads the 8 bytes of a magic and its version at page-aligned offsets of
/// an image, through the page cache or around it.
struct HeadReader<'a> {
    image: BorrowedFd<'a>,
    /// The same file opened again with `O_DIRECT`, where it has it.
    direct: Option<std::fs::File>,
    page: Box<Page>,
    /// Offsets read through the page cache, to drop after.
    buffered: Vec<u64>,
}

impl<'a> HeadReader<'a> {
    fn open(image: BorrowedFd<'a>) -> Self {
        use std::os::unix::fs::OpenOptionsExt;
        // The same inode, whatever its path has become since it was opened.
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(format!("/proc/self/fd/{}", image.as_raw_fd()))
            .ok();
        Self {
            direct,
            ..Self::buffered(image)
        }
    }

    /// A reader through the page cache only.
    fn buffered(image: BorrowedFd<'a>) -> Self {
        Self {
            image,
            direct: None,
            page: Box::new(Page([0; 4096])),
            buffered: Vec::new(),
        }
    }

    /// The magic and version at `offset` (page-aligned), or `None` past the
    /// end of the file.
    fn at(&mut self, offset: u64) -> Result<Option<([u8; 6], u16)>, CryptError> {
        let buf = &mut self.page.0;
        let read = |fd: BorrowedFd<'_>, buf: &mut [u8]| loop {
            match rustix::io::pread(fd, &mut *buf, offset) {
                Err(rustix::io::Errno::INTR) => continue,
                r => break r,
            }
        };
        let got = match &self.direct {
            Some(f) => read(f.as_fd(), buf),
            None => {
                self.buffered.push(offset);
                read(self.image, buf)
            }
        }
        .map_err(|e| CryptError::Read(e.into()))?;
        // One read of a page-aligned page returns all of it up to the end
        // of the file; fewer than 8 bytes is a file that ends there.
        if got < 8 {
            return Ok(None);
        }
        let mut magic = [0u8; 6];
        magic.copy_from_slice(&buf[..6]);
        Ok(Some((magic, u16::from_be_bytes([buf[6], buf[7]]))))
    }

    /// Drops the clean pages a buffered read cached (a filesystem without
    /// `O_DIRECT`); best effort, as the look itself needs none of it.
    fn forget(&self) {
        for &offset in &self.buffered {
            let len = std::num::NonZeroU64::new(self.page.0.len() as u64);
            let _ = rustix::fs::fadvise(self.image, offset, len, rustix::fs::Advice::DontNeed);
        }
    }
}

/// Whether `image` has a LUKS header of any version, readable or not (by
/// its magic: see [`magic`]).
pub fn is_luks(image: BorrowedFd<'_>) -> Result<bool, CryptError> {
    Ok(magic(image)? != Magic::Plain)
}

/// The LUKS2 layout of `image`, or `None` when it has no LUKS header at
/// all. A LUKS header of another version is [`CryptError::Unsupported`]; a
/// LUKS2 one cryptsetup cannot read is [`CryptError::Unreadable`]; a host
/// whose cryptsetup cannot run says [`CryptError::Missing`] for a LUKS2
/// file only (a plain file needs no program).
pub fn header(image: BorrowedFd<'_>) -> Result<Option<Layout>, CryptError> {
    match magic(image)? {
        Magic::Plain => Ok(None),
        Magic::Luks { version: 2, offset } => match layout(image) {
            Ok(l) => Ok(Some(l)),
            Err(CryptError::Failed { message, .. } | CryptError::Output { message, .. }) => {
                Err(CryptError::Unreadable { offset, message })
            }
            Err(e) => Err(e),
        },
        Magic::Luks { version, offset } => Err(CryptError::Unsupported { version, offset }),
    }
}

/// Checks that `key` opens a key slot of `image` (without opening it). An
/// image without key slots (erased) opens with no key.
pub fn check_key(image: BorrowedFd<'_>, key: &[u8]) -> Result<(), CryptError> {
    let checked = Run::new("open")
        .args(&["--test-passphrase", "--type", "luks2"])
        .key(key)
        .image(image)
        .run();
    match checked {
        Err(CryptError::Failed { .. }) if layout(image)?.key_slots.is_empty() => {
            Err(CryptError::WrongKey)
        }
        other => other,
    }
}

/// The image's layout, read from its header.
pub fn layout(image: BorrowedFd<'_>) -> Result<Layout, CryptError> {
    let out = Run::new("luksDump")
        .args(&["--dump-json-metadata"])
        .image(image)
        .output()?;
    parse_layout(&out)
}

fn parse_layout(json: &[u8]) -> Result<Layout, CryptError> {
    let bad = |message: String| CryptError::Output {
        op: "luksDump",
        message,
    };
    let doc: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| bad(format!("not JSON: {e}")))?;
    let segment = &doc["segments"]["0"];
    let payload_offset = segment["offset"]
        .as_str()
        .and_then(|o| o.parse().ok())
        .ok_or_else(|| bad("no offset of segment 0".into()))?;
    let cipher = segment["encryption"]
        .as_str()
        .ok_or_else(|| bad("no cipher of segment 0".into()))?
        .to_string();
    let mut key_slots: Vec<u32> = doc["keyslots"]
        .as_object()
        .ok_or_else(|| bad("no keyslots".into()))?
        .keys()
        .filter_map(|k| k.parse().ok())
        .collect();
    key_slots.sort_unstable();
    Ok(Layout {
        payload_offset,
        cipher,
        key_slots,
    })
}

/// Adds a key slot opened by `new_key`, given a key that opens one already:
/// the new slot's number.
pub fn add_key(
    image: BorrowedFd<'_>,
    key: &[u8],
    new_key: &[u8],
    kdf: Kdf,
) -> Result<u32, CryptError> {
    let before = layout(image)?.key_slots;
    Run::new("luksAddKey")
        .args(&["--batch-mode"])
        .args(&kdf.args())
        .key(key)
        .new_key(new_key)
        .image(image)
        .run()?;
    let after = layout(image)?.key_slots;
    after
        .into_iter()
        .find(|s| !before.contains(s))
        .ok_or_else(|| CryptError::Output {
            op: "luksAddKey",
            message: "no new key slot after it succeeded".into(),
        })
}

/// Removes the key slot `slot`, authorized by `key` (which must open a slot
/// of the image, that one or another).
pub fn remove_key(image: BorrowedFd<'_>, slot: u32, key: &[u8]) -> Result<(), CryptError> {
    check_key(image, key)?;
    Run::new("luksKillSlot")
        .args(&["--batch-mode"])
        .key(key)
        .image(image)
        .args(&[&slot.to_string()])
        .run()
}

/// Destroys every key slot of `image` (`cryptsetup erase`): no key opens
/// it again, wherever copies of its payload survive.
pub fn erase(image: BorrowedFd<'_>) -> Result<(), CryptError> {
    Run::new("erase").args(&["--batch-mode"]).image(image).run()
}

/// The path of an open device named `name`.
pub fn device_of(name: &str) -> PathBuf {
    Path::new("/dev/mapper").join(name)
}

/// Whether a device named `name` is open.
pub fn is_open(name: &str) -> bool {
    device_of(name).exists()
}

/// Opens the LUKS2 payload on `device` (the volume's device, which serves
/// the image file) as `/dev/mapper/<name>` with `key`: the plaintext.
pub fn open(device: &Path, name: &str, key: &[u8], read_only: bool) -> Result<PathBuf, CryptError> {
    let mut run = Run::new("open").args(&[
        "--type",
        "luks2",
        // The volume key stays in the dm table, not the kernel keyring: a
        // resize then needs no key.
        "--disable-keyring",
    ]);
    if read_only {
        run = run.args(&["--readonly"]);
    }
    run.key(key)
        .args(&[&device.to_string_lossy(), name])
        .run()?;
    Ok(device_of(name))
}

/// Closes `/dev/mapper/<name>`; one not open is not an error.
pub fn close(name: &str) -> Result<(), CryptError> {
    if !is_open(name) {
        return Ok(());
    }
    Run::new("close").args(&[name]).run()
}

/// Sets or clears the read-only flag of `/dev/mapper/<name>` (`BLKROSET`,
/// as `blockdev --setro` does): the plaintext device refuses writes as its
/// backend's device does once made read-only live.
pub fn set_read_only(name: &str, read_only: bool) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    const BLKROSET: libc::c_ulong = 0x125d;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device_of(name))?;
    let flag: libc::c_int = read_only.into();
    // SAFETY: BLKROSET reads one int from the pointer, which outlives the call.
    if unsafe { libc::ioctl(dev.as_raw_fd(), BLKROSET, &flag) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `/dev/mapper/<name>` follow its device's new size.
pub fn resize(name: &str) -> Result<(), CryptError> {
    Run::new("resize").args(&[name]).run()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    const FAST: Kdf = Kdf::Fixed {
        iterations: Kdf::MIN_ITERATIONS,
        memory_kib: Kdf::MIN_MEMORY_KIB,
    };

    /// Each key slot's argon2id (time cost, memory KiB), by slot.
    fn slot_costs(f: &std::fs::File) -> Vec<(String, u64, u64)> {
        let out = Run::new("luksDump")
            .args(&["--dump-json-metadata"])
            .image(f.as_fd())
            .output()
            .unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let mut slots: Vec<_> = doc["keyslots"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(n, s)| {
                let kdf = &s["kdf"];
                assert_eq!(kdf["type"], "argon2id", "slot {n}: {kdf}");
                let cost = |k: &str| kdf[k].as_u64().unwrap();
                (n.clone(), cost("time"), cost("memory"))
            })
            .collect();
        slots.sort();
        slots
    }

    #[test]
    fn a_fixed_cost_is_every_new_slots_and_a_timed_one_is_benchmarked() {
        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 32 << 20);
        let fixed = Kdf::Fixed {
            iterations: 5,
            memory_kib: 64,
        };
        format(f.as_fd(), b"first key", 16 << 20, fixed).unwrap();
        add_key(f.as_fd(), b"first key", b"second key", fixed).unwrap();
        assert_eq!(
            slot_costs(&f),
            vec![("0".into(), 5, 64), ("1".into(), 5, 64)]
        );
        // A timed slot gets what the benchmark chose, not the fixed cost.
        add_key(
            f.as_fd(),
            b"first key",
            b"third key",
            Kdf::Timed { unlock_ms: 100 },
        )
        .unwrap();
        let timed = slot_costs(&f).pop().unwrap();
        assert_eq!(timed.0, "2");
        assert_ne!((timed.1, timed.2), (5, 64), "{timed:?}");
        check_key(f.as_fd(), b"third key").unwrap();
    }

    fn image(dir: &tempfile::TempDir, size: u64) -> std::fs::File {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("x.img"))
            .unwrap();
        f.set_len(size).unwrap();
        f
    }

    #[test]
    fn a_formatted_image_opens_with_its_keys_only_until_erased() {
        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 32 << 20);
        assert!(!is_luks(f.as_fd()).unwrap());
        assert!(header(f.as_fd()).unwrap().is_none());
        format(f.as_fd(), b"first key", 16 << 20, FAST).unwrap();
        assert!(is_luks(f.as_fd()).unwrap());
        let l = layout(f.as_fd()).unwrap();
        assert_eq!(l.key_slots, vec![0]);
        assert_eq!(l.payload_offset, 16 << 20);
        assert_eq!(l.cipher, "aes-xts-plain64");
        check_key(f.as_fd(), b"first key").unwrap();
        assert!(matches!(
            check_key(f.as_fd(), b"first kex"),
            Err(CryptError::WrongKey)
        ));

        let slot = add_key(f.as_fd(), b"first key", b"second key", FAST).unwrap();
        assert_eq!(slot, 1);
        check_key(f.as_fd(), b"second key").unwrap();
        assert!(matches!(
            add_key(f.as_fd(), b"wrong", b"third", FAST),
            Err(CryptError::WrongKey)
        ));
        remove_key(f.as_fd(), 0, b"second key").unwrap();
        assert_eq!(layout(f.as_fd()).unwrap().key_slots, vec![1]);
        assert!(matches!(
            check_key(f.as_fd(), b"first key"),
            Err(CryptError::WrongKey)
        ));

        erase(f.as_fd()).unwrap();
        assert!(layout(f.as_fd()).unwrap().key_slots.is_empty());
        assert!(matches!(
            check_key(f.as_fd(), b"second key"),
            Err(CryptError::WrongKey)
        ));
    }

    /// A file of 8 MiB of zeros with `magic` and `version` (big-endian) at
    /// each of `offsets`.
    fn with_magic(
        dir: &tempfile::TempDir,
        magic: &[u8],
        version: u16,
        offsets: &[u64],
    ) -> std::fs::File {
        use std::os::unix::fs::FileExt;
        let f = image(dir, 8 << 20);
        for &off in offsets {
            f.write_all_at(magic, off).unwrap();
            f.write_all_at(&version.to_be_bytes(), off + 6).unwrap();
        }
        f
    }

    #[test]
    fn a_luks_header_is_known_by_its_magic_alone() {
        // Bytes alone, no header cryptsetup could read: what they are is
        // still LUKS, never plain.
        for (magic, version, offsets) in [
            (&b"LUKS\xba\xbe"[..], 1, &[0u64][..]),
            (b"LUKS\xba\xbe", 2, &[0]),
            (b"SKUL\xba\xbe", 2, &[16 << 10]),
            (b"SKUL\xba\xbe", 2, &[4 << 20]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let f = with_magic(&dir, magic, version, offsets);
            let name = String::from_utf8_lossy(magic);
            assert!(
                is_luks(f.as_fd()).unwrap(),
                "{name} v{version} at {offsets:?} was taken for plain"
            );
            // Which header it is comes from the magic too, before any
            // program reads it.
            let want = Magic::Luks {
                version,
                offset: offsets[0],
            };
            assert_eq!(magic_of(&f), want, "{name} at {offsets:?}");
        }
        // Not LUKS: zeros, a magic off the standard offsets, a secondary
        // magic at 0.
        for (magic, version, offsets) in [
            (&b"LUKS\xba\xbe"[..], 2, &[][..]),
            (b"SKUL\xba\xbe", 2, &[12 << 10]),
            (b"SKUL\xba\xbe", 2, &[0]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let f = with_magic(&dir, magic, version, offsets);
            let name = String::from_utf8_lossy(magic);
            assert!(!is_luks(f.as_fd()).unwrap(), "{name} at {offsets:?}");
            assert!(
                matches!(header(f.as_fd()), Ok(None)),
                "{name} at {offsets:?}"
            );
        }
        // A LUKS1 magic is refused by its version, with no program asked.
        let dir = tempfile::tempdir().unwrap();
        let f = with_magic(&dir, MAGIC, 1, &[0]);
        assert!(matches!(
            header(f.as_fd()),
            Err(CryptError::Unsupported {
                version: 1,
                offset: 0
            })
        ));
        // A file shorter than a magic is plain.
        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 3);
        assert_eq!(magic_of(&f), Magic::Plain);
    }

    #[test]
    fn a_magic_is_read_through_the_page_cache_where_direct_io_is_not() {
        let buffered = |f: &std::fs::File| read_magic(HeadReader::buffered(f.as_fd())).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = with_magic(&dir, MAGIC_SECONDARY, 2, &[64 << 10]);
        let want = Magic::Luks {
            version: 2,
            offset: 64 << 10,
        };
        assert_eq!(buffered(&f), want);
        assert_eq!(magic_of(&f), want);
        let dir = tempfile::tempdir().unwrap();
        let f = with_magic(&dir, MAGIC, 1, &[0]);
        let want = Magic::Luks {
            version: 1,
            offset: 0,
        };
        assert_eq!(buffered(&f), want);
        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 100);
        assert_eq!(buffered(&f), Magic::Plain);
        assert_eq!(magic_of(&f), Magic::Plain);
    }

    fn magic_of(f: &std::fs::File) -> Magic {
        magic(f.as_fd()).unwrap()
    }

    /// Formats `f` with cryptsetup itself as `version` (`luks1`, `luks2`).
    fn luks_format(f: &std::fs::File, version: &str) {
        let fd = f.as_fd();
        Run::new("luksFormat")
            .args(&["--type", version, "--batch-mode", "--pbkdf", "pbkdf2"])
            .args(&["--pbkdf-force-iterations", "1000"])
            .key(b"k")
            .image(fd)
            .run()
            .unwrap();
    }

    #[test]
    fn a_luks1_or_damaged_luks2_header_is_luks() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 32 << 20);
        luks_format(&f, "luks1");
        assert!(
            is_luks(f.as_fd()).unwrap(),
            "a LUKS1 file was taken for plain"
        );
        let e = header(f.as_fd()).unwrap_err();
        assert!(
            matches!(
                e,
                CryptError::Unsupported {
                    version: 1,
                    offset: 0
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("LUKS1"), "{e}");

        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 32 << 20);
        luks_format(&f, "luks2");
        // Both JSON areas (after each 4 KiB binary header of the default
        // 16 KiB headers) damaged.
        f.write_all_at(&[b'x'; 12 << 10], 4 << 10).unwrap();
        f.write_all_at(&[b'x'; 12 << 10], 20 << 10).unwrap();
        assert!(
            is_luks(f.as_fd()).unwrap(),
            "a damaged LUKS2 file was taken for plain"
        );
        let e = header(f.as_fd()).unwrap_err();
        assert!(matches!(e, CryptError::Unreadable { offset: 0, .. }), "{e}");

        // Only the primary header gone, magic and all: the secondary's magic
        // says LUKS2, and cryptsetup reads that copy.
        let dir = tempfile::tempdir().unwrap();
        let f = image(&dir, 32 << 20);
        luks_format(&f, "luks2");
        f.write_all_at(&[0; 16 << 10], 0).unwrap();
        assert_eq!(
            magic_of(&f),
            Magic::Luks {
                version: 2,
                offset: 16 << 10
            }
        );
        let l = header(f.as_fd()).unwrap().expect("a LUKS2 layout");
        assert_eq!(l.key_slots, vec![0]);
    }

    #[test]
    fn the_layout_is_read_from_the_headers_json() {
        let json = br#"{"keyslots":{"2":{},"0":{}},"segments":{"0":{"type":"crypt","offset":"16777216","encryption":"aes-xts-plain64"}}}"#;
        let l = parse_layout(json).unwrap();
        assert_eq!(l.key_slots, vec![0, 2]);
        assert_eq!(l.payload_offset, 16 << 20);
        assert!(matches!(
            parse_layout(b"{}"),
            Err(CryptError::Output { .. })
        ));
    }
}
