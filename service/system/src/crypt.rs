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
}

/// How hard a key is to guess by trying: the time an unlock takes on this
/// host (cryptsetup's `--iter-time`), which sizes argon2id's work.
#[derive(Debug, Clone, Copy)]
pub struct Kdf {
    /// Milliseconds one unlock should take here.
    pub unlock_ms: u32,
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

    fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
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
            "--pbkdf",
            "argon2id",
            "--iter-time",
            &kdf.unlock_ms.to_string(),
        ])
        .key(key)
        .image(image)
        .run()
}

/// Whether `image` starts with a LUKS2 header.
pub fn is_luks(image: BorrowedFd<'_>) -> Result<bool, CryptError> {
    match Run::new("isLuks")
        .args(&["--type", "luks2"])
        .image(image)
        .run()
    {
        Ok(()) => Ok(true),
        Err(CryptError::Failed { .. }) => Ok(false),
        Err(e) => Err(e),
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
        .args(&[
            "--batch-mode",
            "--pbkdf",
            "argon2id",
            "--iter-time",
            &kdf.unlock_ms.to_string(),
        ])
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

    const FAST: Kdf = Kdf { unlock_ms: 100 };

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
