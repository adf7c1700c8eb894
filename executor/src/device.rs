//! Where a worker computes and how it talks to its peers, chosen at run time: `--device
//! cpu|cuda`, `--comm tcp|nccl`, `--gpus-per-node G` of `lzrun` (also the environment variables
//! [`ENV_DEVICE`], [`ENV_COMM`], [`ENV_GPUS_PER_NODE`], which is how `lzrun local` and `lzrun
//! agent` hand the choice to the workers they start).
//!
//! The binary resolves the choice once ([`DeviceChoice::resolve`]), checks it
//! ([`DeviceChoice::preflight`]: without the `cuda` feature, or without a driver and a device,
//! one clear error) and installs it for the process ([`set_process_choice`]); a worker opens
//! its device with [`worker_device`]. A process that installed nothing computes on the CPU
//! (tests, benches, library users).

use std::sync::OnceLock;

use candle_core::Device;

/// Environment variable carrying `--device` to agents and workers.
pub const ENV_DEVICE: &str = "LZRUN_DEVICE";
/// Environment variable carrying `--comm`.
pub const ENV_COMM: &str = "LZRUN_COMM";
/// Environment variable carrying `--gpus-per-node`.
pub const ENV_GPUS_PER_NODE: &str = "LZRUN_GPUS_PER_NODE";
/// Environment variable carrying a worker's CUDA device ordinal (set by its agent).
pub const ENV_DEVICE_ORDINAL: &str = "LZRUN_DEVICE_ORDINAL";

/// What a worker computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// candle on the CPU (f32).
    #[default]
    Cpu,
    /// candle on a CUDA GPU (feature `cuda`).
    Cuda,
}

/// The workers' data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommKind {
    /// [`TcpCommunicator`](crate::comm::TcpCommunicator): host buffers over TCP.
    #[default]
    Tcp,
    /// `NcclCommunicator` (feature `cuda`).
    Nccl,
}

impl DeviceKind {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }

    /// Parses a flag value (`cpu` or `cuda`).
    pub fn parse(s: &str) -> Result<Self, DeviceError> {
        match s.trim() {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            other => Err(DeviceError::BadValue {
                what: "--device",
                value: other.to_owned(),
                expected: "cpu or cuda",
            }),
        }
    }
}

impl CommKind {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            CommKind::Tcp => "tcp",
            CommKind::Nccl => "nccl",
        }
    }

    /// Parses a flag value (`tcp` or `nccl`).
    pub fn parse(s: &str) -> Result<Self, DeviceError> {
        match s.trim() {
            "tcp" => Ok(CommKind::Tcp),
            "nccl" => Ok(CommKind::Nccl),
            other => Err(DeviceError::BadValue {
                what: "--comm",
                value: other.to_owned(),
                expected: "tcp or nccl",
            }),
        }
    }
}

/// Why the requested device or data plane cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// A flag or environment value that is not one of the choices.
    #[error("{what} {value:?}: expected {expected}")]
    BadValue {
        /// The flag.
        what: &'static str,
        /// The value given.
        value: String,
        /// The accepted values.
        expected: &'static str,
    },
    /// `--device cuda` in a binary built without the `cuda` feature.
    #[error(
        "--device cuda: this lzrun was built without CUDA support (rebuild with `--features cuda` \
         after `source kernels/setup-cuda.sh`)"
    )]
    NotBuilt,
    /// The driver or the device is missing or unusable.
    #[error("--device cuda: no usable CUDA device {ordinal} ({reason})")]
    NoDevice {
        /// The device ordinal tried.
        ordinal: usize,
        /// What the driver said.
        reason: String,
    },
    /// `--comm nccl` with `--device cpu`.
    #[error("--comm nccl needs --device cuda (NCCL moves device buffers)")]
    NcclOnCpu,
    /// `--gpus-per-node 0`.
    #[error("--gpus-per-node must be at least 1")]
    NoGpus,
}

/// The resolved device, data plane and GPUs per node of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceChoice {
    /// Where workers compute.
    pub device: DeviceKind,
    /// How workers exchange tokens and gradients.
    pub comm: CommKind,
    /// Workers (GPUs) per node: an agent runs this many workers.
    pub gpus_per_node: usize,
    /// The CUDA device ordinal of this worker (0 unless its agent set one).
    pub ordinal: usize,
}

impl Default for DeviceChoice {
    fn default() -> Self {
        Self {
            device: DeviceKind::Cpu,
            comm: CommKind::Tcp,
            gpus_per_node: 1,
            ordinal: 0,
        }
    }
}

impl DeviceChoice {
    /// Applies the defaults: `cuda` implies `nccl` unless `comm` is given.
    pub fn resolve(
        device: DeviceKind,
        comm: Option<CommKind>,
        gpus_per_node: usize,
    ) -> Result<Self, DeviceError> {
        if gpus_per_node == 0 {
            return Err(DeviceError::NoGpus);
        }
        let comm = comm.unwrap_or(match device {
            DeviceKind::Cpu => CommKind::Tcp,
            DeviceKind::Cuda => CommKind::Nccl,
        });
        if comm == CommKind::Nccl && device == DeviceKind::Cpu {
            return Err(DeviceError::NcclOnCpu);
        }
        Ok(Self {
            device,
            comm,
            gpus_per_node,
            ordinal: 0,
        })
    }

    /// Checks that this process can run workers with this choice: the `cuda` feature is
    /// built in and device `ordinal` opens (driver present, device visible; `--comm nccl` needs
    /// `--device cuda`, checked by [`Self::resolve`]). Cheap enough to run before starting any
    /// process.
    pub fn preflight(&self) -> Result<(), DeviceError> {
        if self.device == DeviceKind::Cuda {
            check_cuda(self.ordinal)?;
        }
        Ok(())
    }

    /// This choice with the device ordinal its agent set ([`ENV_DEVICE_ORDINAL`]; 0 if unset).
    pub fn with_ordinal_from_env(mut self) -> Result<Self, DeviceError> {
        if let Ok(v) = std::env::var(ENV_DEVICE_ORDINAL) {
            self.ordinal = v.trim().parse().map_err(|_| DeviceError::BadValue {
                what: ENV_DEVICE_ORDINAL,
                value: v.clone(),
                expected: "a device ordinal (0, 1, ...)",
            })?;
        }
        Ok(self)
    }

    /// The environment that hands this choice to child processes (agents, workers).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            (ENV_DEVICE, self.device.as_str().to_owned()),
            (ENV_COMM, self.comm.as_str().to_owned()),
            (ENV_GPUS_PER_NODE, self.gpus_per_node.to_string()),
        ]
    }

    /// The candle device of this choice (CPU, or CUDA device `ordinal`).
    pub fn open(&self) -> Result<Device, DeviceError> {
        match self.device {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => open_cuda(self.ordinal),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device, DeviceError> {
    // candle reports a missing driver or device as an error; the unwind guard only keeps a
    // driver surprise from turning into a panic message.
    let r = std::panic::catch_unwind(|| Device::new_cuda(ordinal));
    match r {
        Ok(Ok(d)) => Ok(d),
        Ok(Err(e)) => Err(DeviceError::NoDevice {
            ordinal,
            reason: e.to_string().lines().next().unwrap_or("").to_owned(),
        }),
        Err(_) => Err(DeviceError::NoDevice {
            ordinal,
            reason: "the CUDA driver panicked while opening the device".into(),
        }),
    }
}

/// Driver present and device `ordinal` visible, without creating a context (`cuInit`,
/// `cuDeviceGetCount`): what `lzrun local` checks before starting any process.
#[cfg(feature = "cuda")]
fn check_cuda(ordinal: usize) -> Result<(), DeviceError> {
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if usize::try_from(n).is_ok_and(|n| ordinal < n) => Ok(()),
        Ok(n) => Err(DeviceError::NoDevice {
            ordinal,
            reason: format!("the driver reports {n} devices"),
        }),
        Err(e) => Err(DeviceError::NoDevice {
            ordinal,
            reason: format!("{e:?}"),
        }),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt)
}

#[cfg(not(feature = "cuda"))]
fn check_cuda(_ordinal: usize) -> Result<(), DeviceError> {
    Err(DeviceError::NotBuilt)
}

/// Peak dense BF16 tensor-core TFLOP/s of the GPU the driver names `device_name` (as
/// `nvidia-smi` shows it), the denominator of MFU; `None` for a GPU not in this table.
///
/// From NVIDIA's datasheets, which quote H100 and H200 figures "with sparsity" (2:4
/// structured), twice the dense rate a training step can use:
/// * H100 SXM and H200 (SXM; GH200 alike): 1,979 with sparsity, **989** dense (NVIDIA H100
///   Tensor Core GPU datasheet; NVIDIA H200 Tensor Core GPU datasheet);
/// * H100 PCIe: 1,513 with sparsity, **756** dense (H100 datasheet);
/// * A100, SXM4 and PCIe, 40 and 80 GB: **312** dense (NVIDIA A100 Tensor Core GPU datasheet).
///
/// NVL variants are left out (their figures changed between datasheet revisions), as is every
/// other GPU: pass `--peak-tflops` for them. There is no CPU entry on purpose: a CPU's peak
/// depends on its cores, clocks and vector units, and a guessed one would make an MFU that
/// means nothing.
pub fn peak_bf16_tflops(device_name: &str) -> Option<f64> {
    let name = device_name.to_ascii_uppercase();
    if name.contains("NVL") {
        None
    } else if name.contains("H100") && name.contains("PCIE") {
        Some(756.0)
    } else if name.contains("H100") || name.contains("H200") {
        Some(989.0)
    } else if name.contains("A100") {
        Some(312.0)
    } else {
        None
    }
}

/// The name the driver gives CUDA device `ordinal` (`cuDeviceGetName`, e.g. `NVIDIA H200`),
/// without creating a context: what `lzrun local` looks the device's peak up by.
#[cfg(feature = "cuda")]
pub fn cuda_device_name(ordinal: usize) -> Result<String, DeviceError> {
    use cudarc::driver::result;
    let no = |reason: String| DeviceError::NoDevice { ordinal, reason };
    result::init().map_err(|e| no(format!("{e:?}")))?;
    let ord = std::ffi::c_int::try_from(ordinal).map_err(|e| no(e.to_string()))?;
    let dev = result::device::get(ord).map_err(|e| no(format!("{e:?}")))?;
    result::device::get_name(dev).map_err(|e| no(format!("{e:?}")))
}

/// Without the `cuda` feature there is no CUDA device to name.
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_name(_ordinal: usize) -> Result<String, DeviceError> {
    Err(DeviceError::NotBuilt)
}

/// Whether this binary was built with CUDA support (feature `cuda`).
pub const fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}

static CHOICE: OnceLock<DeviceChoice> = OnceLock::new();

/// Installs the process's choice (once; a later call is ignored and returns `false`).
pub fn set_process_choice(choice: DeviceChoice) -> bool {
    CHOICE.set(choice).is_ok()
}

/// The process's choice ([`DeviceChoice::default`], the CPU, when none was installed).
pub fn process_choice() -> DeviceChoice {
    CHOICE.get().copied().unwrap_or_default()
}

/// The device a worker of this process computes on.
pub fn worker_device() -> Result<Device, DeviceError> {
    process_choice().open()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_implies_nccl_unless_told() {
        let c = DeviceChoice::resolve(DeviceKind::Cuda, None, 1).unwrap();
        assert_eq!(c.comm, CommKind::Nccl);
        let c = DeviceChoice::resolve(DeviceKind::Cuda, Some(CommKind::Tcp), 4).unwrap();
        assert_eq!((c.comm, c.gpus_per_node), (CommKind::Tcp, 4));
        let c = DeviceChoice::resolve(DeviceKind::Cpu, None, 1).unwrap();
        assert_eq!(c, DeviceChoice::default());
        assert_eq!(
            DeviceChoice::resolve(DeviceKind::Cpu, Some(CommKind::Nccl), 1),
            Err(DeviceError::NcclOnCpu)
        );
        assert_eq!(
            DeviceChoice::resolve(DeviceKind::Cpu, None, 0),
            Err(DeviceError::NoGpus)
        );
    }

    #[test]
    fn values_parse_and_name_the_problem() {
        assert_eq!(DeviceKind::parse("cuda"), Ok(DeviceKind::Cuda));
        assert_eq!(CommKind::parse("tcp"), Ok(CommKind::Tcp));
        let e = DeviceKind::parse("gpu").unwrap_err();
        assert_eq!(e.to_string(), "--device \"gpu\": expected cpu or cuda");
    }

    #[test]
    fn cpu_preflight_passes_and_cuda_fails_cleanly_without_a_device() {
        DeviceChoice::default().preflight().unwrap();
        assert!(matches!(DeviceChoice::default().open(), Ok(Device::Cpu)));
        let cuda = DeviceChoice::resolve(DeviceKind::Cuda, Some(CommKind::Tcp), 1).unwrap();
        match cuda.preflight() {
            Ok(()) => assert!(cuda_built(), "a device opened without CUDA support"),
            Err(DeviceError::NotBuilt) => assert!(!cuda_built()),
            Err(e @ DeviceError::NoDevice { .. }) => {
                assert!(cuda_built());
                let line = e.to_string();
                assert!(
                    line.starts_with("--device cuda: no usable CUDA device 0"),
                    "{line}"
                );
                assert!(!line.contains('\n'), "{line}");
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }

    /// The names the driver reports (`nvidia-smi --query-gpu=name`) map to the datasheets'
    /// dense BF16 peaks; anything else is unknown rather than guessed.
    #[test]
    fn peaks_by_device_name() {
        for (name, peak) in [
            ("NVIDIA H100 80GB HBM3", Some(989.0)),
            ("NVIDIA H200", Some(989.0)),
            ("NVIDIA H100 PCIe", Some(756.0)),
            ("NVIDIA A100-SXM4-80GB", Some(312.0)),
            ("NVIDIA A100-PCIE-40GB", Some(312.0)),
            ("NVIDIA H100 NVL", None),
            ("NVIDIA H200 NVL", None),
            ("NVIDIA GeForce RTX 3090", None),
            ("NVIDIA H20", None),
            ("", None),
        ] {
            assert_eq!(peak_bf16_tflops(name), peak, "{name}");
        }
    }
}
