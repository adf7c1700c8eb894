//! Process-wide settings of glibc's allocator for training on the CPU.
//!
//! A training step allocates a fresh tensor per op and frees it within the step. glibc serves
//! every block above `M_MMAP_THRESHOLD` (dynamic, at most 32 MiB by default) with its own
//! `mmap` and gives it back with `munmap` on free, so the embedding's gradients, the logits
//! and their log-softmax chain come back every step as new zero pages: at the GPT-S shape
//! page faults were about a quarter of a step's samples. [`tune`] raises the mmap threshold
//! to 1 GiB and the trim threshold to 2 GiB so that such blocks are reused from the heap (see
//! `man mallopt`). That holds for the main thread, where the bench and `lzrun`'s workers train
//! (candle allocates an op's output on the calling thread); another thread's arena cannot hold
//! a block above its 64 MiB heap and still maps it. `M_ARENA_MAX = 1` would cover those too but
//! was not measured to help one training thread (same page faults), so arenas are left alone.
//!
//! The cost is resident memory: what a step freed stays in the process for the next one, so a
//! trainer's resident set stays at its step's peak between steps instead of falling back to
//! the live weights (measured in `results/executor/README.md`). Only the allocator changes;
//! the arithmetic and its bits do not.
//!
//! `LAZARUS_MALLOC_TUNING=0` leaves glibc's defaults; so does any glibc setting of its own in
//! the environment (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`,
//! `MALLOC_ARENA_MAX`, `GLIBC_TUNABLES`), which this never overrides. Elsewhere than Linux with
//! glibc it does nothing.

/// Blocks up to this size come from the heap, so a freed one is reused by the next step.
pub const MMAP_THRESHOLD_BYTES: usize = 1 << 30;
/// Free memory at the top of the heap is returned to the kernel only above this size (2 GiB,
/// the largest `mallopt` takes: a C `int`).
pub const TRIM_THRESHOLD_BYTES: usize = i32::MAX as usize;

/// The environment variable that turns [`tune`] off (`0`, `off` or `false`).
pub const TUNING_ENV: &str = "LAZARUS_MALLOC_TUNING";

/// What [`tune`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MallocTuning {
    /// The two thresholds above are set.
    Tuned,
    /// Turned off by [`TUNING_ENV`].
    Off,
    /// The environment carries glibc settings of its own, left as they are.
    Environment,
    /// Not glibc, or glibc refused a setting (the ones before it stay).
    Unsupported,
}

impl MallocTuning {
    /// A short name for logs and benchmark output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tuned => "tuned",
            Self::Off => "off",
            Self::Environment => "environment",
            Self::Unsupported => "unsupported",
        }
    }
}

/// Whether `env` (a variable's value, if set) turns the tuning off.
fn turned_off(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim(), "0" | "off" | "false"))
}

/// glibc variables that already configure the allocator.
const GLIBC_ENV: [&str; 5] = [
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
    "GLIBC_TUNABLES",
];

/// Sets the allocator for training (module docs). Call it first in `main`; calling it again is
/// harmless.
pub fn tune() -> MallocTuning {
    if turned_off(std::env::var(TUNING_ENV).ok().as_deref()) {
        return MallocTuning::Off;
    }
    if GLIBC_ENV.iter().any(|k| std::env::var_os(k).is_some()) {
        return MallocTuning::Environment;
    }
    set()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() -> MallocTuning {
    let settings = [
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    ];
    for (param, value) in settings {
        let Ok(value) = libc::c_int::try_from(value) else {
            return MallocTuning::Unsupported;
        };
        // SAFETY: mallopt only changes allocator parameters; it takes glibc's own lock.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return MallocTuning::Unsupported;
        }
    }
    MallocTuning::Tuned
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() -> MallocTuning {
    MallocTuning::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_values() {
        assert!(turned_off(Some("0")));
        assert!(turned_off(Some(" off ")));
        assert!(turned_off(Some("false")));
        assert!(!turned_off(Some("1")));
        assert!(!turned_off(None));
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn large_blocks_come_back_from_the_heap() {
        // The point of the tuning: a freed block above glibc's default mmap ceiling (32 MiB)
        // is reused, not mapped afresh. Measured as minor page faults of this thread's second
        // allocation of the same size (a fresh mapping faults once per 4 KiB page it touches;
        // without `set()` this fails).
        fn minor_faults() -> i64 {
            let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
            // SAFETY: getrusage fills the struct it is given.
            let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
            assert_eq!(rc, 0);
            // SAFETY: initialised by the successful call above.
            unsafe { usage.assume_init() }.ru_minflt
        }
        if std::env::var_os(TUNING_ENV).is_some()
            || GLIBC_ENV.iter().any(|k| std::env::var_os(k).is_some())
        {
            return; // the environment decides; nothing to check
        }
        assert_eq!(set(), MallocTuning::Tuned);
        // 48 MiB: above glibc's default ceiling, below a thread arena's 64 MiB heap (the test
        // runs on a harness thread, which may have its own arena already).
        let bytes = 48 << 20;
        let touch = |v: &mut Vec<u8>| {
            v.resize(bytes, 1);
            std::hint::black_box(&v);
        };
        let mut first = Vec::with_capacity(bytes);
        touch(&mut first);
        drop(first);
        let before = minor_faults();
        let mut second = Vec::with_capacity(bytes);
        touch(&mut second);
        let faults = minor_faults() - before;
        drop(second);
        // A fresh 48 MiB mapping faults ~12,288 times.
        assert!(
            faults < 1_000,
            "{faults} minor faults reusing a freed 48 MiB block"
        );
    }
}
