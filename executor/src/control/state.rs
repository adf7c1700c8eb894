//! The controller's saved job state: one file, `controller-state`, in the state directory
//! (`lzrun controller --state-dir DIR`), replaced atomically at every change — written to a
//! temporary file, `fsync`ed, renamed over the old one, and the directory `fsync`ed — so a
//! reader sees either the previous state or the new one whole, whenever the controller dies.
//!
//! # Format
//! One header line, then the state as JSON (readable with `jq` for a post-mortem):
//!
//! ```text
//! lzrun-controller-state 1 <JSON bytes> <FNV-1a 64 of the JSON, 16 hex digits>
//! {"params": …, "machine": …, …}
//! ```
//!
//! Reading checks the header, the length (a cut file) and the checksum (a damaged one) before
//! it parses anything, and every failure is a [`StateError`] that says which file and what is
//! wrong with it — never a panic.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::checkpoint::fnv64;

/// The state file's name in the state directory.
pub const STATE_FILE: &str = "controller-state";

/// Version of the file layout (the header and the JSON document), bumped on any change.
pub const STATE_FORMAT_VERSION: u32 = 1;

const MAGIC: &str = "lzrun-controller-state";

/// Largest state file read (1 GiB): far above any real job's (a plan for 1000 nodes is a few
/// MiB), and a bound on what a damaged length field can make a reader allocate.
const MAX_STATE_BYTES: u64 = 1 << 30;

/// Why the saved state could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "no saved controller state in {}: {STATE_FILE} is missing (is it the --state-dir of a \
         job?)",
        dir.display()
    )]
    Missing { dir: PathBuf },
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("the saved controller state {} is damaged: {why}", path.display())]
    Damaged { path: PathBuf, why: String },
    #[error(
        "the saved controller state {} has format version {found}; this lzrun reads version \
         {STATE_FORMAT_VERSION}",
        path.display()
    )]
    Version { path: PathBuf, found: u32 },
    #[error("cannot encode the controller state: {0}")]
    Encode(serde_json::Error),
    #[error(
        "the token does not match the job saved in {}: it was saved by a controller with \
         another token, and every agent of the job would be refused (give --recover the job's \
         token: --token or LZRUN_TOKEN)",
        path.display()
    )]
    WrongToken { path: PathBuf },
    /// The saved job has ended (finished, or failed): a controller has nothing to take back.
    #[error("{}", over_message(dir, outcome.as_ref()))]
    Over {
        dir: PathBuf,
        /// How it ended (`None`: a state saved before the outcome was recorded).
        outcome: Option<Result<(), String>>,
    },
}

fn over_message(dir: &Path, outcome: Option<&Result<(), String>>) -> String {
    let dir = dir.display();
    match outcome {
        Some(Ok(())) => format!(
            "the job saved in {dir} finished: it trained all its steps and committed its final \
             checkpoint, so there is nothing to recover (to train on, start a new job with \
             --resume on its checkpoint directory)"
        ),
        Some(Err(why)) => format!(
            "the job saved in {dir} failed ({why}), so there is nothing to recover (to go on \
             from its newest checkpoint, start a new job with --resume on its checkpoint \
             directory)"
        ),
        None => format!(
            "the job saved in {dir} has ended, so there is nothing to recover (to go on from \
             its newest checkpoint, start a new job with --resume on its checkpoint directory)"
        ),
    }
}

/// Domain separation of [`token_fingerprint`]'s hash.
const FINGERPRINT_DOMAIN: &[u8] = b"lzrun cluster token v1\0";

fn fingerprint_with(salt: &[u8], token: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(FINGERPRINT_DOMAIN);
    h.update(salt);
    h.update(token.as_bytes());
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What the saved state holds instead of the cluster token: `sha256:SALT:HASH`, the SHA-256
/// of a domain tag, 16 random salt bytes and the token (hex). It tells a `--recover` with
/// the wrong token apart without saving the token (a reader of the state directory learns
/// nothing a guess-and-check attack on the token itself would not).
pub fn token_fingerprint(token: &str) -> String {
    let salt: [u8; 16] = rand::random();
    format!("sha256:{}:{}", hex(&salt), fingerprint_with(&salt, token))
}

/// Whether `token` is the one `fingerprint` ([`token_fingerprint`]) was made from; an error
/// (why) when the fingerprint is not one.
pub fn token_matches(fingerprint: &str, token: &str) -> Result<bool, String> {
    let bad = || format!("its token fingerprint {fingerprint:?} is malformed");
    let mut parts = fingerprint.split(':');
    let (Some("sha256"), Some(salt), Some(hash), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let salt = (0..salt.len())
        .step_by(2)
        .map(|i| {
            salt.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(bad)?;
    let want = fingerprint_with(&salt, token);
    // Constant time over the hash's hex digits.
    Ok(want.len() == hash.len()
        && want
            .bytes()
            .zip(hash.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0)
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The file's bytes for `state`.
pub fn encode_state<T: Serialize>(state: &T) -> Result<Vec<u8>, StateError> {
    let json = serde_json::to_vec(state).map_err(StateError::Encode)?;
    let mut out = format!(
        "{MAGIC} {STATE_FORMAT_VERSION} {} {:016x}\n",
        json.len(),
        fnv64(&json)
    )
    .into_bytes();
    out.extend_from_slice(&json);
    Ok(out)
}

/// The state in a file's bytes; `path` names the file in errors.
pub fn decode_state<T: DeserializeOwned>(bytes: &[u8], path: &Path) -> Result<T, StateError> {
    let damaged = |why: String| StateError::Damaged {
        path: path.to_path_buf(),
        why,
    };
    let Some(eol) = bytes.iter().position(|&b| b == b'\n') else {
        return Err(damaged(format!(
            "no header line in its {} bytes (empty or cut short)",
            bytes.len()
        )));
    };
    let header =
        std::str::from_utf8(&bytes[..eol]).map_err(|_| damaged("the header is not text".into()))?;
    let fields: Vec<&str> = header.split(' ').collect();
    let [magic, version, len, sum] = fields[..] else {
        return Err(damaged(format!(
            "the header {:?} does not have 4 fields",
            crate::control::printable(header, 80)
        )));
    };
    if magic != MAGIC {
        return Err(damaged(format!(
            "it does not start with {MAGIC:?} (not a controller state file)"
        )));
    }
    let found: u32 = version
        .parse()
        .map_err(|_| damaged(format!("bad format version {version:?}")))?;
    if found != STATE_FORMAT_VERSION {
        return Err(StateError::Version {
            path: path.to_path_buf(),
            found,
        });
    }
    let len: usize = len
        .parse()
        .map_err(|_| damaged(format!("bad length {len:?}")))?;
    let sum = u64::from_str_radix(sum, 16).map_err(|_| damaged(format!("bad checksum {sum:?}")))?;
    let json = &bytes[eol + 1..];
    if json.len() != len {
        return Err(damaged(format!(
            "it holds {} bytes of state where its header announces {len} (cut short or \
             appended to)",
            json.len()
        )));
    }
    if fnv64(json) != sum {
        return Err(damaged("its checksum does not match its contents".into()));
    }
    serde_json::from_slice(json).map_err(|e| damaged(format!("its state does not parse: {e}")))
}

/// Replaces `dir/controller-state` with `state`, atomically (see the [module docs](self)).
pub fn write_state<T: Serialize>(dir: &Path, state: &T) -> Result<(), StateError> {
    let bytes = encode_state(state)?;
    let tmp = dir.join(format!(".{STATE_FILE}.tmp"));
    let dst = dir.join(STATE_FILE);
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        f.write_all(&bytes).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        drop(f);
        fs::rename(&tmp, &dst).map_err(io_err("rename into place", &dst))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    sync_dir(dir)
}

/// Reads the state saved in `dir`.
pub fn read_state<T: DeserializeOwned>(dir: &Path) -> Result<T, StateError> {
    let path = dir.join(STATE_FILE);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(StateError::Missing {
                dir: dir.to_path_buf(),
            });
        }
        Err(e) => return Err(io_err("open", &path)(e)),
    };
    let size = file.metadata().map_err(io_err("stat", &path))?.len();
    if size > MAX_STATE_BYTES {
        return Err(StateError::Damaged {
            path,
            why: format!("it is {size} bytes, more than the {MAX_STATE_BYTES} read"),
        });
    }
    let bytes = fs::read(&path).map_err(io_err("read", &path))?;
    decode_state(&bytes, &path)
}

/// Makes the rename inside `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), StateError> {
    let f = File::open(dir).map_err(io_err("open directory", dir))?;
    match f.sync_all() {
        Ok(()) => Ok(()),
        // Some file systems cannot fsync a directory; their renames are as durable as they get.
        Err(e)
            if e.raw_os_error() == Some(libc::EINVAL) || e.kind() == io::ErrorKind::Unsupported =>
        {
            Ok(())
        }
        Err(e) => Err(io_err("fsync directory", dir)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct S {
        step: u64,
        names: Vec<String>,
    }

    fn sample() -> S {
        S {
            step: 7,
            names: vec!["n0".into(), "n1".into()],
        }
    }

    #[test]
    fn a_state_round_trips_and_every_damage_is_a_clear_error() {
        let p = Path::new("controller-state");
        let bytes = encode_state(&sample()).unwrap();
        assert_eq!(decode_state::<S>(&bytes, p).unwrap(), sample());
        let err = |b: &[u8]| decode_state::<S>(b, p).unwrap_err().to_string();
        // Every cut, including the empty file and a cut header.
        for cut in 0..bytes.len() {
            let e = err(&bytes[..cut]);
            assert!(e.contains("is damaged"), "cut at {cut}: {e}");
        }
        let mut flipped = bytes.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 0x01;
        assert!(err(&flipped).contains("checksum"), "{}", err(&flipped));
        let mut longer = bytes.clone();
        longer.extend_from_slice(b"{}");
        assert!(err(&longer).contains("cut short or appended"));
        assert!(err(b"hello world\n{}").contains("4 fields"));
        assert!(err(b"something-else 1 2 3\n").contains("not a controller state"));
        let newer = String::from_utf8(bytes.clone())
            .unwrap()
            .replacen(" 1 ", " 99 ", 1);
        let e = err(newer.as_bytes());
        assert!(e.contains("format version 99"), "{e}");
        // A consistent file whose JSON is not the state.
        let other = encode_state(&serde_json::json!({"step": "seven"})).unwrap();
        assert!(err(&other).contains("does not parse"), "{}", err(&other));
        assert!(err(&[0xff, 0xfe, b'\n']).contains("not text"));
    }

    #[test]
    fn a_token_fingerprint_matches_its_token_only_and_does_not_hold_it() {
        let fp = token_fingerprint("fail-over");
        assert!(fp.starts_with("sha256:"), "{fp}");
        assert!(!fp.contains("fail-over"));
        assert_eq!(token_matches(&fp, "fail-over"), Ok(true));
        assert_eq!(token_matches(&fp, "fail-ovex"), Ok(false));
        assert_eq!(token_matches(&fp, ""), Ok(false));
        // Salted: the same token fingerprints differently each time, and each matches.
        let again = token_fingerprint("fail-over");
        assert_ne!(fp, again);
        assert_eq!(token_matches(&again, "fail-over"), Ok(true));
        for bad in [
            "",
            "md5:00:00",
            "sha256:zz:00",
            "sha256:0:00",
            "sha256:00:00:00",
        ] {
            assert!(token_matches(bad, "x").is_err(), "{bad}");
        }
    }

    #[test]
    fn writing_replaces_the_file_whole_and_a_missing_one_is_named() {
        let dir = std::env::temp_dir().join(format!("lzrun-state-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let e = read_state::<S>(&dir).unwrap_err();
        assert!(matches!(e, StateError::Missing { .. }), "{e}");
        write_state(&dir, &sample()).unwrap();
        let mut next = sample();
        next.step = 8;
        write_state(&dir, &next).unwrap();
        assert_eq!(read_state::<S>(&dir).unwrap(), next);
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![STATE_FILE.to_owned()], "no temporary file left");
        let _ = fs::remove_dir_all(&dir);
    }
}
