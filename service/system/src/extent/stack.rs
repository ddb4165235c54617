//! The device stack under a filesystem (rule 4): its block device, resolved
//! through sysfs and device-mapper `linear` tables (only) down to raw
//! devices, and the translation of a byte range through it.

use std::fmt;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::MapError;

/// A block device number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DevNum {
    /// The major number: the driver.
    pub major: u32,
    /// The minor number: the device of that driver.
    pub minor: u32,
}

impl fmt::Display for DevNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

impl DevNum {
    /// From a `st_dev` / `st_rdev` value.
    pub fn from_dev(dev: u64) -> Self {
        Self {
            major: rustix::fs::major(dev),
            minor: rustix::fs::minor(dev),
        }
    }

    fn sys(&self) -> PathBuf {
        PathBuf::from(format!("/sys/dev/block/{self}"))
    }

    fn sys_read(&self, attr: &str) -> io::Result<String> {
        std::fs::read_to_string(self.sys().join(attr)).map(|s| s.trim().to_string())
    }

    /// The device's node under /dev (from its uevent's DEVNAME: devtmpfs names
    /// nodes so, with or without udev).
    pub fn node(&self) -> io::Result<PathBuf> {
        let uevent = self.sys_read("uevent")?;
        uevent
            .lines()
            .find_map(|l| l.strip_prefix("DEVNAME="))
            .map(|n| PathBuf::from("/dev").join(n))
            .ok_or_else(|| io::Error::other(format!("no DEVNAME for block device {self}")))
    }

    /// Size in bytes.
    pub fn size(&self) -> io::Result<u64> {
        self.sys_read("size")?
            .parse::<u64>()
            .map(|s| s * 512)
            .map_err(io::Error::other)
    }
}

/// A block device as rule 4 sees it: raw, or a dm device made only of linear
/// targets over other layers.
#[derive(Debug)]
pub(super) enum Layer {
    Raw(DevNum),
    Linear(DevNum, Vec<LinearTarget>),
}

/// `start len linear dev offset`, in bytes.
#[derive(Debug)]
pub(super) struct LinearTarget {
    start: u64,
    len: u64,
    below: Layer,
    offset: u64,
}

const MAX_DEPTH: usize = 8;

impl Layer {
    pub(super) fn resolve(dev: DevNum, depth: usize) -> Result<Self, MapError> {
        let err = |reason: String| MapError::Device {
            dev: dev.to_string(),
            reason,
        };
        if depth > MAX_DEPTH {
            return Err(err("device-mapper stack deeper than 8".into()));
        }
        if !dev.sys().exists() {
            return Err(err("not in /sys/dev/block".into()));
        }
        let Ok(name) = dev.sys_read("dm/name") else {
            return Ok(Layer::Raw(dev));
        };
        let table =
            crate::dm::table(&name).map_err(|e| err(format!("reading dm table of {name}: {e}")))?;
        let mut targets = Vec::new();
        for (start, len, kind, params) in table.targets {
            if kind != "linear" {
                return Err(MapError::Target {
                    dev: format!("{dev} ({name})"),
                    target: kind,
                });
            }
            let mut p = params.split_whitespace();
            let (Some(below), Some(offset)) =
                (p.next(), p.next().and_then(|o| o.parse::<u64>().ok()))
            else {
                return Err(err(format!("unexpected linear parameters '{params}'")));
            };
            let below = parse_devnum(below)
                .ok_or_else(|| err(format!("unexpected device '{below}' in table")))?;
            targets.push(LinearTarget {
                start: start * 512,
                len: len * 512,
                below: Layer::resolve(below, depth + 1)?,
                offset: offset * 512,
            });
        }
        Ok(Layer::Linear(dev, targets))
    }

    /// Maps `[physical, physical + len)` of this layer to raw devices:
    /// `(device, offset on it, length, offset within the input range)`.
    pub(super) fn translate(
        &self,
        physical: u64,
        len: u64,
    ) -> Result<Vec<(DevNum, u64, u64, u64)>, MapError> {
        match self {
            Layer::Raw(dev) => Ok(vec![(*dev, physical, len, 0)]),
            Layer::Linear(dev, targets) => {
                let mut out = Vec::new();
                let mut at = physical;
                let end = physical + len;
                while at < end {
                    let t = targets
                        .iter()
                        .find(|t| t.start <= at && at < t.start + t.len)
                        .ok_or_else(|| MapError::Device {
                            dev: dev.to_string(),
                            reason: format!("byte {at} is outside its table"),
                        })?;
                    let n = (t.start + t.len - at).min(end - at);
                    for (d, p, l, within) in t.below.translate(t.offset + (at - t.start), n)? {
                        out.push((d, p, l, at - physical + within));
                    }
                    at += n;
                }
                Ok(out)
            }
        }
    }
}

fn parse_devnum(s: &str) -> Option<DevNum> {
    let (ma, mi) = s.split_once(':')?;
    Some(DevNum {
        major: ma.parse().ok()?,
        minor: mi.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_layers_translate_and_split() {
        let raw = DevNum { major: 8, minor: 0 };
        let layer = Layer::Linear(
            DevNum {
                major: 253,
                minor: 0,
            },
            vec![
                LinearTarget {
                    start: 0,
                    len: 1 << 20,
                    below: Layer::Raw(raw),
                    offset: 10 << 20,
                },
                LinearTarget {
                    start: 1 << 20,
                    len: 1 << 20,
                    below: Layer::Raw(raw),
                    offset: 50 << 20,
                },
            ],
        );
        let t = layer.translate((1 << 20) - 4096, 8192).unwrap();
        assert_eq!(
            t,
            vec![
                (raw, (11 << 20) - 4096, 4096, 0),
                (raw, 50 << 20, 4096, 4096),
            ]
        );
        assert!(layer.translate(2 << 20, 512).is_err());
    }
}
