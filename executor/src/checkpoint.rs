//! Atomic, verifiable checkpoints of an `lzrun` training run.
//!
//! Every worker holds the dense model (with its AdamW state) and some expert replicas (each with
//! its own AdamW state). When a failure loses every replica of some expert, the survivors restore
//! from the newest checkpoint, so a checkpoint must never be half-visible and must prove its
//! own integrity.
//!
//! # Layout
//!
//! ```text
//! root/
//!   latest                      pointer: "step-00000012\n", the current checkpoint
//!   step-00000012/              a committed checkpoint; training resumes at step 12
//!     manifest.json             format version, step, world, plan version, MoeConfig, and the
//!                               size + FNV-1a 64 of every part, sorted by name
//!     dense.bin                 postcard OptimState: dense parameters + AdamW moments + step
//!     expert-l000-e0000.bin     postcard ExpertState: one per (layer, expert)
//!     ...
//!   step-00000008/              older committed checkpoints (the newest `keep` are kept)
//!   .staging-step-00000016/     parts of a checkpoint still being written (no manifest)
//! ```
//!
//! # Protocol
//!
//! 1. Each worker writes the parts it is responsible for ([`parts_of`]: rank 0 the dense part,
//!    every expert its lowest-ranked holder, [`writer_of`]) with [`write_part`] into the staging
//!    directory of the step, concurrently with the other workers. Each part goes through a
//!    temporary file, `fsync`, `rename`, and an `fsync` of the staging directory.
//! 2. The coordinator gathers the returned [`PartInfo`]s and calls [`commit`], which re-reads
//!    every part (a worker's report is not proof that the bytes are on disk), writes
//!    `manifest.json` the same way, renames the staging directory to `step-XXXXXXXX`, `fsync`s
//!    the root, then replaces `latest` (write `latest.tmp`, `fsync`, `rename`, `fsync` root) and
//!    finally prunes old checkpoints.
//! 3. [`load_latest`] verifies the checkpoint named by `latest` (manifest, config, size and
//!    checksum of every part) and falls back to the other committed directories, newest first,
//!    recording why each was rejected.
//!
//! # Why a crash at any point leaves a loadable checkpoint
//!
//! A new checkpoint becomes visible only through two renames, each atomic on POSIX file
//! systems, and each done only after everything it exposes is durable:
//!
//! * Before the staging → `step-*` rename, the new data lives in a directory that loading
//!   never considers (it is not named `step-*`); `latest` and the old checkpoint are untouched.
//! * Between the two renames, `latest` still names the old checkpoint, which loads. The new
//!   directory is complete (its manifest and parts were `fsync`ed before the rename); a fallback
//!   may use it and a later commit of the same step replaces it.
//! * `latest` is replaced by renaming a fully written and `fsync`ed `latest.tmp` over it, so it
//!   holds either the old name or the new one, never a torn mix.
//! * Pruning starts only after `latest` names the new checkpoint, never touches the directory
//!   `latest` names, and renames a directory to a `.trash-*` name before deleting it, so a
//!   half-deleted directory is never mistaken for a checkpoint.
//!
//! Damage that happens anyway (lost writes on a lying disk, bit flips, truncation, someone
//! editing a file) is caught by the sizes and checksums in the manifest, and loading falls back
//! to an older checkpoint. FNV-1a detects accidents, not tampering.
//!
//! # Assumptions
//!
//! Workers and coordinator must see the same `root`: they write into one directory and rely on
//! each other's renames. That holds for processes on one machine; across machines `root` must
//! be on a shared file system (NFS, Lustre, ...) with atomic `rename` and close-to-open
//! consistency. Only one coordinator commits at a time, and within one run commits go in
//! increasing step order: committing step `s` discards committed checkpoints newer than `s`,
//! which can only come from a history abandoned by restoring an older checkpoint.

use crate::faults::DISK_FULL_FAILPOINT_ENV;
use crate::model::{ExpertState, Fnv64, MoeConfig, OptimState};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Name of the pointer file in the root naming the current checkpoint directory.
pub const POINTER: &str = "latest";
/// Version of the on-disk format written by this build; other versions are rejected.
pub const FORMAT_VERSION: u32 = 1;

const POINTER_TMP: &str = "latest.tmp";
const STEP_PREFIX: &str = "step-";
const STAGING_PREFIX: &str = ".staging-";
const TRASH_PREFIX: &str = ".trash-";
/// Digits of the step in a directory name (more when the step needs them).
const STEP_DIGITS: usize = 8;
/// Read size when hashing parts (keeps memory flat for multi-GiB parts).
const HASH_CHUNK_BYTES: usize = 1 << 20;

/// Why a checkpoint operation failed. Every variant names the path (or part) it is about.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("part {name} in {}: missing", dir.display())]
    PartMissing { dir: PathBuf, name: String },
    #[error(
        "part {name} in {}: {actual_bytes} bytes on disk, manifest says {expected_bytes} (truncated or overwritten)",
        dir.display()
    )]
    PartSize {
        dir: PathBuf,
        name: String,
        actual_bytes: u64,
        expected_bytes: u64,
    },
    #[error(
        "part {name} in {}: checksum mismatch (fnv64 {actual:016x}, manifest says {expected:016x})",
        dir.display()
    )]
    PartChecksum {
        dir: PathBuf,
        name: String,
        actual: u64,
        expected: u64,
    },
    #[error("part {name} is not listed in {}", manifest.display())]
    NotInManifest { manifest: PathBuf, name: String },
    #[error(
        "step {step}: expected part {name} is not in the manifest (its writer did not report it)"
    )]
    ExpectedPartMissing { step: u64, name: String },
    #[error("invalid part name {name:?}: {reason}")]
    InvalidPartName { name: String, reason: &'static str },
    #[error("{} missing", path.display())]
    ManifestMissing { path: PathBuf },
    #[error("{} unparseable: {source}", path.display())]
    ManifestParse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: {reason}", path.display())]
    ManifestInvalid { path: PathBuf, reason: String },
    #[error("config differs: {diff}")]
    ConfigMismatch { dir: PathBuf, diff: String },
    #[error("pointer {}: {reason}", path.display())]
    Pointer { path: PathBuf, reason: String },
    #[error("cannot decode {what}: {source}")]
    Decode {
        what: String,
        source: postcard::Error,
    },
    #[error("cannot decode {what}: {trailing_bytes} bytes left after the encoded value")]
    TrailingBytes { what: String, trailing_bytes: usize },
    #[error("{what}: {reason}")]
    InvalidState { what: String, reason: String },
    #[error("{what}: {field}[{index}] is {value}, refusing to checkpoint a non-finite state")]
    NonFinite {
        what: String,
        field: String,
        index: usize,
        value: f32,
    },
    #[error(
        "part {part}: {what}: {field}[{index}] is {value}, but a checkpoint never holds a \
         non-finite value (damaged, or written by a faulty writer): refusing to restore it"
    )]
    NonFiniteStored {
        part: String,
        what: String,
        field: String,
        index: usize,
        value: f32,
    },
    #[error("no staging directory {} for step {step} (no part was written)", dir.display())]
    NoStaging { dir: PathBuf, step: u64 },
    #[error("{} is the current checkpoint and has a different manifest", dir.display())]
    AlreadyCommitted { dir: PathBuf },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error(
        "checkpoint directory {} is in use by another job ({holder}); give each job its own directory",
        root.display()
    )]
    Locked { root: PathBuf, holder: String },
    #[error("no valid checkpoint under {}{}", root.display(), describe_rejected(rejected))]
    NoCheckpoint {
        root: PathBuf,
        rejected: Vec<(PathBuf, String)>,
    },
}

fn describe_rejected(rejected: &[(PathBuf, String)]) -> String {
    rejected
        .iter()
        .map(|(p, why)| format!("; rejected {}: {why}", p.display()))
        .collect()
}

/// Attaches the operation and path to an I/O error.
trait IoContext<T> {
    fn ctx(self, op: &'static str, path: &Path) -> Result<T, CheckpointError>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, op: &'static str, path: &Path) -> Result<T, CheckpointError> {
        self.map_err(|source| CheckpointError::Io {
            op,
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Size and checksum of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    pub name: String,
    pub bytes: u64,
    /// FNV-1a 64 over the file's bytes.
    pub fnv64: u64,
}

impl PartInfo {
    /// The info of a part with these contents.
    pub fn of(name: &str, bytes: &[u8]) -> Self {
        Self {
            name: name.to_owned(),
            bytes: bytes.len() as u64,
            fnv64: fnv64(bytes),
        }
    }
}

/// The table of contents of a committed checkpoint (`manifest.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// The next step to train after restoring (= steps completed).
    pub step: u64,
    /// Workers that wrote it.
    pub world: usize,
    pub plan_version: u64,
    pub config: MoeConfig,
    /// Sorted by name.
    pub parts: Vec<PartInfo>,
    /// A global batch: the data cursor at `step` (the position of the next sequence of the
    /// global sample order); restoring rewinds the data with the weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_cursor: Option<u64>,
}

impl Manifest {
    /// A manifest of the current format with `parts` sorted by name.
    pub fn new(
        step: u64,
        world: usize,
        plan_version: u64,
        config: MoeConfig,
        mut parts: Vec<PartInfo>,
    ) -> Self {
        parts.sort_by(|a, b| a.name.cmp(&b.name));
        Self {
            format_version: FORMAT_VERSION,
            step,
            world,
            plan_version,
            config,
            parts,
            data_cursor: None,
        }
    }

    /// The entry of part `name`.
    pub fn part(&self, name: &str) -> Option<&PartInfo> {
        self.parts.iter().find(|p| p.name == name)
    }
}

/// FNV-1a 64 of `bytes` (the checksum stored in [`PartInfo::fnv64`]).
pub fn fnv64(bytes: &[u8]) -> u64 {
    let mut h = Fnv64::default();
    h.write(bytes);
    h.finish()
}

/// `"step-00000012"`: 8 digits, more if the step needs them, so names sort like steps up to
/// 10^8.
pub fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:0width$}", width = STEP_DIGITS)
}

/// The step of a committed directory name as written by [`step_dir_name`]; `None` for anything
/// else (staging and trash directories, non-canonical spellings like `step-012`).
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.len() < STEP_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    // Only the canonical spelling, so one step has exactly one directory name.
    (step_dir_name(step) == name).then_some(step)
}

/// `root/.staging-step-00000012`: where workers write the parts of `step` before the commit.
pub fn staging_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("{STAGING_PREFIX}{}", step_dir_name(step)))
}

/// The dense model's part.
pub fn dense_part() -> &'static str {
    "dense.bin"
}

/// `"expert-l003-e0012.bin"`.
pub fn expert_part(layer: usize, expert: usize) -> String {
    format!("expert-l{layer:03}-e{expert:04}.bin")
}

/// Part names end up in paths: allow only plain file names, and keep names starting with `.`
/// for temporary files so that a leftover temp file never shadows a part.
fn check_part_name(name: &str) -> Result<(), CheckpointError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name == MANIFEST {
        Some("reserved for the manifest")
    } else if name.starts_with('.') {
        Some("starts with '.' (reserved for temporary files)")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        Some("only ASCII letters, digits, '-', '_' and '.' are allowed")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(CheckpointError::InvalidPartName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // postcard fails only on serde features these plain structs of numbers, strings and Vecs
    // never use (sequences of unknown length, `collect_str`), so this cannot fire.
    postcard::to_stdvec(value).expect("postcard encodes plain structs")
}

fn decode<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, CheckpointError> {
    let (value, rest) =
        postcard::take_from_bytes(bytes).map_err(|source| CheckpointError::Decode {
            what: what.to_owned(),
            source,
        })?;
    // A valid prefix followed by junk is a damaged file, not a valid one.
    if !rest.is_empty() {
        return Err(CheckpointError::TrailingBytes {
            what: what.to_owned(),
            trailing_bytes: rest.len(),
        });
    }
    Ok(value)
}

/// Binary encoding of the dense part.
pub fn encode_dense(s: &OptimState) -> Vec<u8> {
    encode(s)
}

pub fn decode_dense(b: &[u8]) -> Result<OptimState, CheckpointError> {
    decode_dense_as("dense state", b)
}

fn decode_dense_as(what: &str, b: &[u8]) -> Result<OptimState, CheckpointError> {
    let s: OptimState = decode(what, b)?;
    for p in &s.params {
        let n = p.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if n.is_none_or(|n| p.value.len() != n || p.m.len() != n || p.v.len() != n) {
            return Err(CheckpointError::InvalidState {
                what: what.to_owned(),
                reason: format!(
                    "parameter {} of shape {:?} has {}/{}/{} values/m/v",
                    p.name,
                    p.shape,
                    p.value.len(),
                    p.m.len(),
                    p.v.len()
                ),
            });
        }
    }
    Ok(s)
}

/// The first non-finite value of `values`, as an error about `what`'s `field`.
fn check_finite(what: &str, field: &str, values: &[f32]) -> Result<(), CheckpointError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(CheckpointError::NonFinite {
            what: what.to_owned(),
            field: field.to_owned(),
            index,
            value: values[index],
        }),
    }
}

/// Refuses a dense state holding a NaN or an infinity (in a value or a moment): written, it
/// would be a checkpoint whose restore brings the divergence back.
pub fn check_dense_finite(s: &OptimState) -> Result<(), CheckpointError> {
    for p in &s.params {
        for (kind, values) in [("value", &p.value), ("m", &p.m), ("v", &p.v)] {
            check_finite("dense state", &format!("{}.{kind}", p.name), values)?;
        }
    }
    Ok(())
}

/// [`check_dense_finite`] for one expert's weights and moments.
pub fn check_expert_finite(s: &ExpertState) -> Result<(), CheckpointError> {
    let what = format!("expert {} of layer {}", s.expert, s.layer);
    for (field, values) in [
        ("w1", &s.w1),
        ("w2", &s.w2),
        ("m1", &s.m1),
        ("v1", &s.v1),
        ("m2", &s.m2),
        ("v2", &s.v2),
    ] {
        check_finite(&what, field, values)?;
    }
    Ok(())
}

/// Binary encoding of one expert part.
pub fn encode_expert(s: &ExpertState) -> Vec<u8> {
    encode(s)
}

pub fn decode_expert(b: &[u8]) -> Result<ExpertState, CheckpointError> {
    decode_expert_as("expert state", b)
}

fn decode_expert_as(what: &str, b: &[u8]) -> Result<ExpertState, CheckpointError> {
    let s: ExpertState = decode(what, b)?;
    let n = s.d_model.checked_mul(s.d_ff);
    // `w1` is d_model x d_ff (GELU) or d_model x 2·d_ff (SwiGLU, `MoeConfig::w1_cols`); the
    // manifest's config says which, checked against it where the expert is read for a model.
    let n1 = if n.is_some_and(|n| s.w1.len() == 2 * n) {
        n.map(|n| 2 * n)
    } else {
        n
    };
    for (field, len, n) in [
        ("w1", s.w1.len(), n1),
        ("w2", s.w2.len(), n),
        ("m1", s.m1.len(), n1),
        ("v1", s.v1.len(), n1),
        ("m2", s.m2.len(), n),
        ("v2", s.v2.len(), n),
    ] {
        if n != Some(len) {
            return Err(CheckpointError::InvalidState {
                what: what.to_owned(),
                reason: format!(
                    "{field} has {len} values, expected d_model {} x d_ff {}",
                    s.d_model, s.d_ff
                ),
            });
        }
    }
    Ok(s)
}

/// Who writes expert `(layer, expert)`: the lowest rank holding a replica in
/// `replicas[layer][expert][rank]`; `None` if nobody (or out of range).
pub fn writer_of(replicas: &[Vec<Vec<u32>>], layer: usize, expert: usize) -> Option<usize> {
    replicas
        .get(layer)?
        .get(expert)?
        .iter()
        .position(|&n| n > 0)
}

/// One part of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    /// The dense model and its optimizer state ([`dense_part`]).
    Dense,
    /// One expert's weights and optimizer state ([`expert_part`]).
    Expert { layer: usize, expert: usize },
}

impl Part {
    /// The part's file name.
    pub fn name(self) -> String {
        match self {
            Part::Dense => dense_part().to_owned(),
            Part::Expert { layer, expert } => expert_part(layer, expert),
        }
    }
}

/// The parts `rank` must write under that plan: [`Part::Dense`] for rank 0 (every worker holds
/// the same dense state, one copy is enough), plus every expert it is [`writer_of`].
pub fn parts_to_write(replicas: &[Vec<Vec<u32>>], rank: usize) -> Vec<Part> {
    let mut parts = Vec::new();
    if rank == 0 {
        parts.push(Part::Dense);
    }
    for (layer, row) in replicas.iter().enumerate() {
        for expert in 0..row.len() {
            if writer_of(replicas, layer, expert) == Some(rank) {
                parts.push(Part::Expert { layer, expert });
            }
        }
    }
    parts
}

/// Names of the parts `rank` must write under that plan ([`parts_to_write`]). Sorted by name.
pub fn parts_of(replicas: &[Vec<Vec<u32>>], rank: usize) -> Vec<String> {
    parts_to_write(replicas, rank)
        .into_iter()
        .map(Part::name)
        .collect()
}

/// All part names a complete checkpoint of that model has (dense + one per (layer, expert)),
/// sorted by name.
pub fn all_parts(layers: usize, experts: usize) -> Vec<String> {
    std::iter::once(dense_part().to_owned())
        .chain((0..layers).flat_map(|l| (0..experts).map(move |e| expert_part(l, e))))
        .collect()
}

/// Makes renames and creations inside `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    #[cfg(unix)]
    {
        let f = File::open(dir).ctx("open directory", dir)?;
        match f.sync_all() {
            Ok(()) => Ok(()),
            // Some file systems cannot fsync a directory at all; their renames are as durable
            // as they get.
            Err(e)
                if e.raw_os_error() == Some(libc::EINVAL)
                    || e.kind() == io::ErrorKind::Unsupported =>
            {
                Ok(())
            }
            Err(e) => Err(CheckpointError::Io {
                op: "fsync directory",
                path: dir.to_path_buf(),
                source: e,
            }),
        }
    }
    #[cfg(not(unix))]
    {
        // Windows cannot open a directory as a `File`; NTFS journals renames itself.
        let _ = dir;
        Ok(())
    }
}

/// A temp name no other writer uses: processes differ by pid, threads by the counter, and
/// the clock separates pid reuse across machines sharing the file system.
fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether the disk-full failpoint is on: [`DISK_FULL_FAILPOINT_ENV`] names a file that exists
/// (`lzrun local` creates and removes it for a [`crate::faults::Fault::DiskFull`]).
fn disk_full_failpoint() -> bool {
    static MARKER: OnceLock<Option<PathBuf>> = OnceLock::new();
    MARKER
        .get_or_init(|| std::env::var_os(DISK_FULL_FAILPOINT_ENV).map(PathBuf::from))
        .as_deref()
        .is_some_and(Path::exists)
}

/// Writes `dir/name` so that readers see either the old file or the complete new one:
/// write `tmp`, fsync it, rename it over `name`, fsync `dir`.
fn write_atomic(dir: &Path, tmp: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dst = dir.join(name);
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)
            .ctx("create", tmp)?;
        if disk_full_failpoint() {
            // As a full disk does: part of the data lands, then the write fails.
            f.write_all(&bytes[..bytes.len() / 2]).ctx("write", tmp)?;
            return Err(io::Error::from_raw_os_error(libc::ENOSPC)).ctx("write", tmp);
        }
        f.write_all(bytes).ctx("write", tmp)?;
        f.sync_all().ctx("fsync", tmp)?;
        drop(f);
        fs::rename(tmp, &dst).ctx("rename into place", &dst)
    })();
    if written.is_err() {
        // Best effort: the temp name is never loaded, this only saves space.
        let _ = fs::remove_file(tmp);
    }
    written?;
    sync_dir(dir)
}

/// Writes one part into the staging dir of `step` (creating it), through a temp file + fsync +
/// rename; returns its [`PartInfo`]. Rewriting a part (a retry) replaces it atomically.
pub fn write_part(
    root: &Path,
    step: u64,
    name: &str,
    bytes: &[u8],
) -> Result<PartInfo, CheckpointError> {
    check_part_name(name)?;
    let dir = staging_dir(root, step);
    // Several workers race here; create_dir_all tolerates the directory appearing meanwhile.
    fs::create_dir_all(&dir).ctx("create staging directory", &dir)?;
    sync_dir(root)?;
    let tmp = dir.join(format!(".{name}.tmp-{}", unique_suffix()));
    write_atomic(&dir, &tmp, name, bytes)?;
    Ok(PartInfo::of(name, bytes))
}

/// Size and checksum of `path`, streamed.
fn hash_file(path: &Path) -> io::Result<(u64, u64)> {
    let mut f = File::open(path)?;
    let mut h = Fnv64::default();
    let mut buf = vec![0u8; HASH_CHUNK_BYTES];
    let mut total_bytes = 0u64;
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.write(&buf[..n]);
        total_bytes += n as u64;
    }
    Ok((total_bytes, h.finish()))
}

fn check_part(
    dir: &Path,
    info: &PartInfo,
    actual_bytes: u64,
    actual: u64,
) -> Result<(), CheckpointError> {
    if actual_bytes != info.bytes {
        return Err(CheckpointError::PartSize {
            dir: dir.to_path_buf(),
            name: info.name.clone(),
            actual_bytes,
            expected_bytes: info.bytes,
        });
    }
    if actual != info.fnv64 {
        return Err(CheckpointError::PartChecksum {
            dir: dir.to_path_buf(),
            name: info.name.clone(),
            actual,
            expected: info.fnv64,
        });
    }
    Ok(())
}

fn missing_or(dir: &Path, name: &str, op: &'static str, e: io::Error) -> CheckpointError {
    if e.kind() == io::ErrorKind::NotFound {
        CheckpointError::PartMissing {
            dir: dir.to_path_buf(),
            name: name.to_owned(),
        }
    } else {
        CheckpointError::Io {
            op,
            path: dir.join(name),
            source: e,
        }
    }
}

/// Checks size and checksum of one part on disk without holding it in memory.
fn verify_part(dir: &Path, info: &PartInfo) -> Result<(), CheckpointError> {
    check_part_name(&info.name)?;
    let (bytes, sum) =
        hash_file(&dir.join(&info.name)).map_err(|e| missing_or(dir, &info.name, "read", e))?;
    check_part(dir, info, bytes, sum)
}

/// Reads one part and checks it against its manifest entry.
fn read_part(dir: &Path, info: &PartInfo) -> Result<Vec<u8>, CheckpointError> {
    check_part_name(&info.name)?;
    let bytes =
        fs::read(dir.join(&info.name)).map_err(|e| missing_or(dir, &info.name, "read", e))?;
    check_part(dir, info, bytes.len() as u64, fnv64(&bytes))?;
    Ok(bytes)
}

fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(CheckpointError::ManifestMissing { path });
        }
        Err(e) => {
            return Err(CheckpointError::Io {
                op: "read",
                path,
                source: e,
            });
        }
    };
    serde_json::from_slice(&bytes).map_err(|source| CheckpointError::ManifestParse { path, source })
}

/// Structural checks of a manifest: version, step agrees with the directory name, parts
/// sorted, unique and with safe names.
fn check_manifest(dir: &Path, m: &Manifest) -> Result<(), CheckpointError> {
    let invalid = |reason: String| CheckpointError::ManifestInvalid {
        path: dir.join(MANIFEST),
        reason,
    };
    if m.format_version != FORMAT_VERSION {
        return Err(invalid(format!(
            "format version {} (this build reads {FORMAT_VERSION})",
            m.format_version
        )));
    }
    let dir_step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_step_dir_name);
    if let Some(dir_step) = dir_step
        && dir_step != m.step
    {
        return Err(invalid(format!(
            "manifest step {} but the directory is for step {dir_step}",
            m.step
        )));
    }
    for p in &m.parts {
        check_part_name(&p.name).map_err(|e| invalid(e.to_string()))?;
    }
    if let Some(w) = m.parts.windows(2).find(|w| w[0].name >= w[1].name) {
        return Err(invalid(format!(
            "parts not sorted by name or listed twice: {} before {}",
            w[0].name, w[1].name
        )));
    }
    Ok(())
}

/// `value` after a trip through JSON. serde_json's default float parser may land one ulp off,
/// so values read from a manifest are compared with values that took the same trip.
fn json_roundtrip<T: Serialize + DeserializeOwned>(value: &T) -> Result<T, serde_json::Error> {
    serde_json::from_slice(&serde_json::to_vec(value)?)
}

fn check_config(
    dir: &Path,
    stored: &MoeConfig,
    requested: &MoeConfig,
) -> Result<(), CheckpointError> {
    // The precision changes only the arithmetic, never the (f32) state: a run may resume in
    // another one.
    let requested = &MoeConfig {
        precision: stored.precision,
        ..requested.clone()
    };
    if stored == requested || json_roundtrip(requested).is_ok_and(|r| r == *stored) {
        return Ok(());
    }
    Err(CheckpointError::ConfigMismatch {
        dir: dir.to_path_buf(),
        diff: config_diff(stored, requested),
    })
}

/// `"d_model: checkpoint 64, requested 32; ..."`, field by field.
fn config_diff(stored: &MoeConfig, requested: &MoeConfig) -> String {
    use serde_json::Value;
    if let (Ok(Value::Object(a)), Ok(Value::Object(b))) = (
        serde_json::to_value(stored),
        serde_json::to_value(requested),
    ) {
        let diffs: Vec<String> = a
            .iter()
            .filter_map(|(k, va)| {
                let vb = b.get(k).unwrap_or(&Value::Null);
                (va != vb).then(|| format!("{k}: checkpoint {va}, requested {vb}"))
            })
            .collect();
        if !diffs.is_empty() {
            return diffs.join("; ");
        }
    }
    format!("checkpoint {stored:?}, requested {requested:?}")
}

/// Full verification of a committed (or about to be committed) directory: manifest, config
/// (when given) and every part.
fn verify_dir(dir: &Path, config: Option<&MoeConfig>) -> Result<Manifest, CheckpointError> {
    let m = read_manifest(dir)?;
    check_manifest(dir, &m)?;
    if let Some(config) = config {
        check_config(dir, &m.config, config)?;
    }
    for p in &m.parts {
        verify_part(dir, p)?;
    }
    Ok(m)
}

/// [`verify_dir`] for a checkpoint about to be restored: every part is also read whole,
/// decoded and checked to hold finite values only. Checksums cannot catch a NaN the writer put
/// there (they were computed over it); restored, it brings the divergence back and the job
/// blames the learning rate. Each part is read once (size, checksum and contents).
fn verify_dir_for_load(dir: &Path, config: &MoeConfig) -> Result<Manifest, CheckpointError> {
    let m = read_manifest(dir)?;
    check_manifest(dir, &m)?;
    check_config(dir, &m.config, config)?;
    for p in &m.parts {
        let bytes = read_part(dir, p)?;
        let what = dir.join(&p.name).display().to_string();
        let finite = if p.name == dense_part() {
            check_dense_finite(&decode_dense_as(&what, &bytes)?)
        } else {
            check_expert_finite(&decode_expert_as(&what, &bytes)?)
        };
        finite.map_err(|e| match e {
            CheckpointError::NonFinite {
                what,
                field,
                index,
                value,
            } => CheckpointError::NonFiniteStored {
                part: p.name.clone(),
                what,
                field,
                index,
                value,
            },
            other => other,
        })?;
    }
    Ok(m)
}

/// The step `latest` names; `Ok(None)` when there is no pointer (a fresh root, or a crash
/// before the first pointer was written).
/// The step of the checkpoint `latest` names under `root`, if it names one that verifies.
pub fn latest_step(root: &Path) -> Result<Option<u64>, CheckpointError> {
    let Some(step) = read_pointer(root)? else {
        return Ok(None);
    };
    Ok(verify_dir(&root.join(step_dir_name(step)), None)
        .ok()
        .map(|m| m.step))
}

fn read_pointer(root: &Path) -> Result<Option<u64>, CheckpointError> {
    let path = root.join(POINTER);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(CheckpointError::Io {
                op: "read",
                path,
                source: e,
            });
        }
    };
    let text = String::from_utf8_lossy(&bytes);
    let name = text.trim();
    match parse_step_dir_name(name) {
        Some(step) => Ok(Some(step)),
        None => {
            let shown: String = name.chars().take(64).collect();
            Err(CheckpointError::Pointer {
                path,
                reason: format!("does not name a checkpoint directory: {shown:?}"),
            })
        }
    }
}

fn write_pointer(root: &Path, step: u64) -> Result<(), CheckpointError> {
    let contents = format!("{}\n", step_dir_name(step));
    write_atomic(root, &root.join(POINTER_TMP), POINTER, contents.as_bytes())
}

/// Committed directories under `root`, newest step first. A missing root has none.
fn committed_dirs(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(it) => it,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(CheckpointError::Io {
                op: "list",
                path: root.to_path_buf(),
                source: e,
            });
        }
    };
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry.ctx("list", root)?;
        let Some(step) = entry.file_name().to_str().and_then(parse_step_dir_name) else {
            continue;
        };
        if entry.file_type().ctx("stat", &entry.path())?.is_dir() {
            dirs.push((step, entry.path()));
        }
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    Ok(dirs)
}

/// Removes `path`, a directory tree or a single file (anything can end up under a staging or
/// trash name).
fn remove_any(path: &Path) -> Result<(), CheckpointError> {
    let is_dir = fs::symlink_metadata(path)
        .ctx("stat", path)?
        .file_type()
        .is_dir();
    if is_dir {
        fs::remove_dir_all(path).ctx("remove", path)
    } else {
        fs::remove_file(path).ctx("remove", path)
    }
}

/// Renames `dir` out of the `step-*` namespace, then deletes it, so that a crash halfway never
/// leaves a partial directory under a checkpoint name.
fn remove_dir(root: &Path, dir: &Path) -> Result<(), CheckpointError> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let trash = root.join(format!("{TRASH_PREFIX}{name}-{}", unique_suffix()));
    fs::rename(dir, &trash).ctx("move to trash", dir)?;
    sync_dir(root)?;
    remove_any(&trash)
}

/// Keeps the checkpoint `latest` names and, going to older committed directories newest
/// first, every one up to the `keep`-th that verifies; removes the older ones, the committed
/// directories newer than `latest` (a history abandoned by restoring an older checkpoint),
/// staging directories of steps older than the current one (left by a crash, an aborted commit
/// or a failed write) and trash left by an interrupted prune. Returns the removed paths. Does
/// nothing when `latest` is missing or names no directory: without a known current
/// checkpoint, pruning could delete the only one left.
///
/// Only checkpoints that verify count towards `keep`: a damaged one cannot be restored, and
/// counting it would delete a valid older one in its place. A damaged one is left where it is
/// while it lies among the kept ones (whoever investigates the damage finds it) and goes with
/// the older ones once `keep` valid checkpoints are newer. Verifying reads every part of the
/// directories walked: about `keep` checkpoints per call.
///
/// A removal that fails does not stop the others; the first error is returned after all were
/// tried.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let keep = keep.max(1);
    let Some(current) = read_pointer(root)? else {
        return Ok(Vec::new());
    };
    if !root.join(step_dir_name(current)).is_dir() {
        return Ok(Vec::new());
    }
    let mut doomed: Vec<PathBuf> = Vec::new();
    let committed = committed_dirs(root)?;
    doomed.extend(
        committed
            .iter()
            .filter(|(s, _)| *s > current)
            .map(|(_, p)| p.clone()),
    );
    // `current` comes first and is kept whatever it holds: `latest` names it.
    let mut valid = 0;
    for (_, dir) in committed.iter().filter(|(s, _)| *s <= current) {
        if valid >= keep {
            doomed.push(dir.clone());
        } else if verify_dir(dir, None).is_ok() {
            valid += 1;
        }
    }
    let mut removed = Vec::new();
    let mut first_error = None;
    let mut note = |r: Result<(), CheckpointError>, path: PathBuf| match r {
        Ok(()) => removed.push(path),
        Err(e) => {
            first_error.get_or_insert(e);
        }
    };
    for dir in doomed {
        note(remove_dir(root, &dir), dir);
    }
    for entry in fs::read_dir(root).ctx("list", root)? {
        let entry = entry.ctx("list", root)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        if name.starts_with(TRASH_PREFIX) {
            note(remove_any(&path), path);
        } else if let Some(step) = name
            .strip_prefix(STAGING_PREFIX)
            .and_then(parse_step_dir_name)
            && step < current
        {
            // Staging of newer steps may still be receiving parts from workers.
            note(remove_dir(root, &path), path);
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}

/// Removes every staging directory (of any step) and any trash under `root`: the parts of
/// checkpoints that were never committed. Only for when no worker writes into `root` any more
/// (the job is over or was interrupted); committed checkpoints and `latest` are untouched.
pub fn remove_staging(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(it) => it,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(CheckpointError::Io {
                op: "list",
                path: root.to_path_buf(),
                source: e,
            });
        }
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.ctx("list", root)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with(STAGING_PREFIX) || name.starts_with(TRASH_PREFIX) {
            let path = entry.path();
            remove_any(&path)?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// Name of the lock file a job holds in its checkpoint root ([`lock_root`]).
pub const LOCK_FILE: &str = "lzrun.lock";

/// An exclusive lock on a checkpoint root: while it is held no other job commits or prunes
/// there. Released when dropped, and by the kernel when the process ends however it ends
/// (`flock(2)` locks go with the last descriptor), so a killed job leaves no stale lock. The
/// lock file itself stays (removing it would let a job that opened it just before lock a file
/// nobody else can see any more).
#[derive(Debug)]
pub struct RootLock {
    _file: File,
    path: PathBuf,
}

impl RootLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the exclusive lock on `root` ([`RootLock`]) without waiting and writes `holder` (who
/// holds it: pid, host) into the lock file, or fails with [`CheckpointError::Locked`] naming the
/// current holder. Fails too when `root` is not writable (the lock file cannot be created),
/// which is the first thing a job with a read-only checkpoint directory should learn.
///
/// `flock(2)` is advisory and per machine on many network file systems: two controllers on
/// different machines sharing a root over NFS may not see each other's lock.
pub fn lock_root(root: &Path, holder: &str) -> Result<RootLock, CheckpointError> {
    let path = root.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .ctx("create lock file", &path)?;
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: flock(2) on a descriptor owned by `file`, which outlives the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::WouldBlock {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let text = text.trim();
                return Err(CheckpointError::Locked {
                    root: root.to_path_buf(),
                    holder: if text.is_empty() {
                        "unknown".to_owned()
                    } else {
                        text.chars().take(200).collect()
                    },
                });
            }
            return Err(CheckpointError::Io {
                op: "lock",
                path,
                source: err,
            });
        }
    }
    file.set_len(0).ctx("truncate", &path)?;
    file.write_all(holder.as_bytes()).ctx("write", &path)?;
    file.sync_all().ctx("fsync", &path)?;
    Ok(RootLock { _file: file, path })
}

/// Commits the staging dir of `manifest.step`: checks every name in `expected` is present in
/// `manifest.parts`, and every part is on disk with matching size and checksum (re-reading the
/// files), writes the manifest, fsyncs, renames to the step dir, replaces `latest`, prunes to
/// `keep` (>= 1) and removes stale staging dirs of older steps ([`prune`]; its errors are
/// ignored since the checkpoint is committed by then, the next commit retries). Returns the
/// committed directory. Errors leave the previous checkpoint and pointer untouched.
///
/// When the step directory already exists: if it verifies and its manifest equals `manifest`
/// (a retry), `latest` is re-pointed to it; if it verifies, `latest` names it and the manifest
/// differs, this is an error ([`CheckpointError::AlreadyCommitted`]); otherwise — it is damaged
/// (a run that fell back from it trains that step again and must be able to checkpoint it), or
/// `latest` does not name it (a leftover of a crash before the pointer update or of an
/// abandoned history) — the new checkpoint replaces it.
pub fn commit(
    root: &Path,
    manifest: Manifest,
    expected: &[String],
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    if keep == 0 {
        return Err(CheckpointError::InvalidArgument(
            "keep must be at least 1".into(),
        ));
    }
    if manifest.format_version != FORMAT_VERSION {
        return Err(CheckpointError::InvalidArgument(format!(
            "manifest format version {} (this build writes {FORMAT_VERSION})",
            manifest.format_version
        )));
    }
    let mut manifest = manifest;
    manifest.parts.sort_by(|a, b| a.name.cmp(&b.name));
    for p in &manifest.parts {
        check_part_name(&p.name)?;
    }
    if let Some(w) = manifest.parts.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(CheckpointError::InvalidArgument(format!(
            "part {} listed twice",
            w[0].name
        )));
    }
    let step = manifest.step;
    for name in expected {
        if manifest.part(name).is_none() {
            return Err(CheckpointError::ExpectedPartMissing {
                step,
                name: name.clone(),
            });
        }
    }
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| {
        CheckpointError::InvalidArgument(format!("manifest cannot be written as JSON: {e}"))
    })?;
    // What loading will see; refuses values JSON cannot carry (a NaN in the config would be
    // written as null and make the checkpoint unloadable).
    let as_loaded: Manifest = serde_json::from_slice(&json).map_err(|e| {
        CheckpointError::InvalidArgument(format!("manifest does not survive JSON: {e}"))
    })?;

    let final_dir = root.join(step_dir_name(step));
    let mut replace_existing = false;
    if final_dir.exists() {
        let current = read_pointer(root).ok().flatten() == Some(step);
        match verify_dir(&final_dir, None) {
            Ok(existing) if existing == as_loaded => {
                write_pointer(root, step)?;
                let _ = prune(root, keep);
                return Ok(final_dir);
            }
            Ok(_) if current => {
                return Err(CheckpointError::AlreadyCommitted { dir: final_dir });
            }
            // Damaged, or a leftover nobody points to: replaced below (from the staging
            // directory, which must exist).
            _ => {}
        }
        replace_existing = true;
    }

    let staging = staging_dir(root, step);
    if !staging.is_dir() {
        return Err(CheckpointError::NoStaging { dir: staging, step });
    }
    // Workers' reports are not proof: re-read what is actually on disk.
    for p in &manifest.parts {
        verify_part(&staging, p)?;
    }
    let tmp = staging.join(format!(".{MANIFEST}.tmp-{}", unique_suffix()));
    write_atomic(&staging, &tmp, MANIFEST, &json)?;
    if replace_existing {
        remove_dir(root, &final_dir)?;
    }
    fs::rename(&staging, &final_dir).ctx("rename staging directory to", &final_dir)?;
    sync_dir(root)?;
    write_pointer(root, step)?;
    let _ = prune(root, keep);
    Ok(final_dir)
}

/// A verified checkpoint, ready to restore from.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Newer (or pointed-to) checkpoints that failed verification, with the reason.
    pub rejected: Vec<(PathBuf, String)>,
}

/// The newest valid checkpoint under `root`: the one `latest` names if it verifies, otherwise
/// the other committed directories, newest step first. Each rejected candidate (and a broken
/// pointer) is reported in [`Loaded::rejected`]: a damaged part, or one holding a NaN or an
/// infinity ([`CheckpointError::NonFiniteStored`]). `config` must equal the manifest's. Staging
/// directories are never considered.
pub fn load_latest(root: &Path, config: &MoeConfig) -> Result<Loaded, CheckpointError> {
    let mut rejected = Vec::new();
    let mut tried = None;
    match read_pointer(root) {
        Ok(Some(step)) => {
            let dir = root.join(step_dir_name(step));
            if dir.is_dir() {
                match verify_dir_for_load(&dir, config) {
                    Ok(manifest) => {
                        return Ok(Loaded {
                            dir,
                            manifest,
                            rejected,
                        });
                    }
                    Err(e) => rejected.push((dir.clone(), e.to_string())),
                }
            } else {
                rejected.push((
                    dir.clone(),
                    format!("named by {POINTER} but missing (or not a directory)"),
                ));
            }
            tried = Some(dir);
        }
        Ok(None) => {}
        Err(e) => rejected.push((root.join(POINTER), e.to_string())),
    }
    for (_, dir) in committed_dirs(root)? {
        if tried.as_ref() == Some(&dir) {
            continue;
        }
        match verify_dir_for_load(&dir, config) {
            Ok(manifest) => {
                return Ok(Loaded {
                    dir,
                    manifest,
                    rejected,
                });
            }
            Err(e) => rejected.push((dir, e.to_string())),
        }
    }
    Err(CheckpointError::NoCheckpoint {
        root: root.to_path_buf(),
        rejected,
    })
}

impl Loaded {
    /// The step training resumes at.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// Reads and verifies one part (size + checksum again: files can change after
    /// [`load_latest`]).
    pub fn read(&self, name: &str) -> Result<Vec<u8>, CheckpointError> {
        let info = self
            .manifest
            .part(name)
            .ok_or_else(|| CheckpointError::NotInManifest {
                manifest: self.dir.join(MANIFEST),
                name: name.to_owned(),
            })?;
        read_part(&self.dir, info)
    }

    /// The dense model's exported AdamW state.
    pub fn dense(&self) -> Result<OptimState, CheckpointError> {
        let name = dense_part();
        let what = self.dir.join(name).display().to_string();
        decode_dense_as(&what, &self.read(name)?)
    }

    /// The state of expert `(layer, expert)`, checked to be that expert of this model.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<ExpertState, CheckpointError> {
        let name = expert_part(layer, expert);
        let what = self.dir.join(&name).display().to_string();
        let s = decode_expert_as(&what, &self.read(&name)?)?;
        let cfg = &self.manifest.config;
        let reason = if (s.layer, s.expert) != (layer, expert) {
            Some(format!(
                "holds expert ({}, {}), expected ({layer}, {expert})",
                s.layer, s.expert
            ))
        } else if (s.d_model, s.d_ff) != (cfg.d_model, cfg.d_ff)
            || s.w1.len() != cfg.d_model * cfg.w1_cols()
        {
            Some(format!(
                "expert is {}x{}, the model's are {}x{}",
                s.d_model, s.d_ff, cfg.d_model, cfg.d_ff
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(CheckpointError::InvalidState { what, reason }),
            None => Ok(s),
        }
    }
}
