//! Errors: one typed enum for the whole crate, each variant with the Linux
//! errno that the equivalent system call (or access) would produce.
//!
//! Messages name the operation, what was wrong and the offending value, e.g.
//! `mprotect: address not page-aligned (0x7f0000000123)`.

use std::fmt;

/// Which public operation an error came from (used in messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum Op {
    /// [`AddressSpace::mmap`](crate::AddressSpace::mmap).
    Mmap,
    /// [`AddressSpace::munmap`](crate::AddressSpace::munmap).
    Munmap,
    /// [`AddressSpace::mprotect`](crate::AddressSpace::mprotect).
    Mprotect,
    /// [`AddressSpace::madvise`](crate::AddressSpace::madvise).
    Madvise,
    /// A load through [`AddressSpace::read`](crate::AddressSpace::read).
    Read,
    /// A store through [`AddressSpace::write`](crate::AddressSpace::write).
    Write,
    /// A single access through [`AddressSpace::touch`](crate::AddressSpace::touch).
    Touch,
    /// An instruction fetch through [`AddressSpace::fetch`](crate::AddressSpace::fetch).
    Fetch,
    /// An atomic read-modify-write of guest memory
    /// ([`AddressSpace::compare_exchange_u64`](crate::AddressSpace::compare_exchange_u64)
    /// and its siblings).
    Atomic,
    /// [`AddressSpace::fork`](crate::AddressSpace::fork).
    Fork,
    /// [`AddressSpace::msync`](crate::AddressSpace::msync).
    Msync,
    /// [`AddressSpace::mlock`](crate::AddressSpace::mlock).
    Mlock,
    /// [`AddressSpace::munlock`](crate::AddressSpace::munlock).
    Munlock,
    /// [`Vm::new`](crate::Vm::new).
    NewVm,
    /// [`Vm::new_space`](crate::Vm::new_space).
    NewSpace,
    /// [`Vm::attach`](crate::Vm::attach).
    Attach,
    /// [`AddressSpace::mincore`](crate::AddressSpace::mincore).
    Mincore,
    /// [`AddressSpace::brk`](crate::AddressSpace::brk) and
    /// [`AddressSpace::set_heap_start`](crate::AddressSpace::set_heap_start).
    Brk,
    /// [`AddressSpace::mremap`](crate::AddressSpace::mremap).
    Mremap,
    /// [`AddressSpace::host_view`](crate::AddressSpace::host_view) and the
    /// faults and calls of a [`HostView`](crate::HostView).
    HostView,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Mmap => "mmap",
            Op::Munmap => "munmap",
            Op::Mprotect => "mprotect",
            Op::Fork => "fork",
            Op::Msync => "msync",
            Op::Mlock => "mlock",
            Op::Munlock => "munlock",
            Op::Madvise => "madvise",
            Op::Read => "read",
            Op::Write => "write",
            Op::Touch => "touch",
            Op::Fetch => "fetch",
            Op::Atomic => "atomic",
            Op::NewVm => "Vm::new",
            Op::NewSpace => "Vm::new_space",
            Op::Attach => "Vm::attach",
            Op::HostView => "host view",
            Op::Mincore => "mincore",
            Op::Brk => "brk",
            Op::Mremap => "mremap",
        })
    }
}

/// The `si_code` of a SIGSEGV: why an access faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum SegvCode {
    /// No mapping covers the address (`SEGV_MAPERR`).
    MapErr,
    /// A mapping covers the address but does not allow the access (`SEGV_ACCERR`).
    AccErr,
}

impl SegvCode {
    /// The Linux `si_code` value (`SEGV_MAPERR` = 1, `SEGV_ACCERR` = 2).
    pub fn si_code(self) -> i32 {
        match self {
            SegvCode::MapErr => 1,
            SegvCode::AccErr => 2,
        }
    }
}

impl fmt::Display for SegvCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SegvCode::MapErr => "SEGV_MAPERR: address not mapped",
            SegvCode::AccErr => "SEGV_ACCERR: access not permitted by the mapping",
        })
    }
}

/// Everything that can go wrong, with the errno Linux would report.
///
/// ```
/// use vmfault::{Error, SegvCode, Vm, VmConfig};
/// let vm = Vm::new(VmConfig { phys_bytes: 4 << 20, ..VmConfig::default() })?;
/// let space = vm.new_space()?;
/// let err = space.read(0x10_0000, &mut [0u8; 1]).unwrap_err();
/// assert_eq!(err, Error::Segv { addr: 0x10_0000, code: SegvCode::MapErr });
/// assert_eq!(err.errno(), libc::EFAULT);
/// # Ok::<(), vmfault::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bad argument (`EINVAL`): unaligned address, zero length, unknown flag...
    #[error("{op}: {reason} ({value:#x})")]
    InvalidArgument {
        /// The operation.
        op: Op,
        /// What was wrong.
        reason: &'static str,
        /// The offending value.
        value: u64,
    },
    /// Out of physical frames (`ENOMEM`): nothing was installed, nothing leaked.
    #[error("{op}: out of physical memory while allocating {what}")]
    NoMemory {
        /// The operation.
        op: Op,
        /// What could not be allocated (a data page, a page-table page...).
        what: &'static str,
    },
    /// The range is not fully mapped (`ENOMEM`, as mprotect and madvise report holes).
    #[error("{op}: range {addr:#x}..{end:#x} is not fully mapped")]
    NotMapped {
        /// The operation.
        op: Op,
        /// First address of the requested range.
        addr: u64,
        /// End of the requested range.
        end: u64,
    },
    /// No room in the address space for the mapping, or the range lies beyond
    /// the user address space (`ENOMEM`).
    #[error("{op}: no room for {len:#x} bytes at {addr:#x} in the user address space")]
    NoAddressSpace {
        /// The operation.
        op: Op,
        /// The requested (or fixed) address; 0 for "anywhere".
        addr: u64,
        /// The requested length.
        len: u64,
    },
    /// Too many mappings (`ENOMEM`, Linux's `vm.max_map_count`).
    #[error("{op}: the address space already holds {count} mappings (limit {limit})")]
    TooManyMappings {
        /// The operation.
        op: Op,
        /// The current number of mappings.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// `MAP_FIXED_NOREPLACE` over an existing mapping (`EEXIST`).
    #[error("mmap: fixed range {addr:#x}..{end:#x} overlaps an existing mapping")]
    Exists {
        /// Start of the requested range.
        addr: u64,
        /// End of the requested range.
        end: u64,
    },
    /// A file mapping without a file (`EBADF`): `mmap` without `MAP_ANONYMOUS`.
    #[error("{op}: MAP_ANONYMOUS not set and no file given")]
    BadFile {
        /// The operation.
        op: Op,
    },
    /// The file descriptor is closed, or was opened with `O_PATH`
    /// (`EBADF`, Linux's `fget`).
    #[error("{op}: the file descriptor is closed or opened with O_PATH")]
    BadDescriptor {
        /// The operation.
        op: Op,
    },
    /// A file offset plus length past the largest file size, 2^63 - 1
    /// (`EOVERFLOW`).
    #[error("{op}: file offset {offset:#x} plus length {len:#x} ends past the largest file size (2^63 - 1)")]
    Overflow {
        /// The operation.
        op: Op,
        /// The file offset.
        offset: u64,
        /// The length (page-aligned).
        len: u64,
    },
    /// A valid request this kind of mapping does not support
    /// (`EOPNOTSUPP`), e.g. `MAP_SHARED_VALIDATE` with a flag it refuses.
    #[error("{op}: not supported: {reason} ({value:#x})")]
    NotSupported {
        /// The operation.
        op: Op,
        /// What is not supported.
        reason: &'static str,
        /// The offending value.
        value: u64,
    },
    /// The file was not opened for what the mapping needs (`EACCES`): any
    /// mapping needs read access, a shared writable one write access.
    #[error("{op}: the file is not open for {need}")]
    Access {
        /// The operation.
        op: Op,
        /// What the mapping needs: "reading" or "writing".
        need: &'static str,
    },
    /// The file cannot be mapped (`ENODEV`): vmfault maps regular files.
    #[error("{op}: cannot map this file: {what}")]
    NoDevice {
        /// The operation.
        op: Op,
        /// What the file is.
        what: &'static str,
    },
    /// A page of a range to populate could not be faulted in (`ENOMEM`, as
    /// Linux's `mlock` reports a `PROT_NONE` mapping or a file page beyond
    /// the end of the file): the mappings stay locked, the pages before
    /// `addr` are resident.
    #[error("{op}: cannot fault in the page at {addr:#x}: {cause}")]
    Unpopulated {
        /// The operation.
        op: Op,
        /// The page that could not be faulted in.
        addr: u64,
        /// Why.
        cause: &'static str,
    },
    /// Out of physical frames while populating a range (`EAGAIN`, as Linux's
    /// `mlock` reports it): the mappings stay locked, partly populated.
    #[error("{op}: out of physical memory while faulting in {addr:#x}; try again")]
    TryAgain {
        /// The operation.
        op: Op,
        /// The page that could not be faulted in.
        addr: u64,
    },
    /// Not allowed (`EPERM`), e.g. a fixed mapping below `mmap_min_addr`.
    #[error("{op}: not permitted: {reason} ({value:#x})")]
    Permission {
        /// The operation.
        op: Op,
        /// Why.
        reason: &'static str,
        /// The offending value.
        value: u64,
    },
    /// An access a real process would die of with SIGSEGV (`EFAULT` when a
    /// system call meets it). `addr` is the first address that faulted.
    #[error("segmentation fault at {addr:#x}: {code}")]
    Segv {
        /// The first faulting address.
        addr: u64,
        /// Why it faulted.
        code: SegvCode,
    },
    /// An access a real process would die of with SIGBUS (`EFAULT` when a
    /// system call meets it): a page of a file mapping that lies wholly
    /// beyond the end of the file.
    #[error("bus error at {addr:#x}: page {pgoff} of the file lies beyond its end ({size} bytes)")]
    Bus {
        /// The faulting address.
        addr: u64,
        /// The page's offset in the file, in pages.
        pgoff: u64,
        /// The file's size when the fault read it.
        size: u64,
    },
    /// The range to remap is not inside one mapping (`EFAULT`, as Linux's
    /// `mremap` answers): nothing is mapped at `addr`, or `addr + len`
    /// lies past the end of the mapping there.
    #[error("{op}: {addr:#x}..+{len:#x} is not inside one mapping")]
    OutsideMapping {
        /// The operation.
        op: Op,
        /// The start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// Busy (`EBUSY`): `msync(MS_INVALIDATE)` over a locked mapping.
    #[error("{op}: busy: {reason} ({value:#x})")]
    Busy {
        /// The operation.
        op: Op,
        /// What is busy.
        reason: &'static str,
        /// The offending value.
        value: u64,
    },
    /// A file that another user holds (`EBUSY`, as `swapon` answers for a
    /// swap file in use): a swap file another `Vm` uses.
    #[error("{what} {path} is in use by another Vm")]
    InUse {
        /// What the file was to be.
        what: &'static str,
        /// Its path.
        path: String,
    },
    /// The host cannot give what a [`Vm`](crate::Vm) of this size needs
    /// at creation (`ENOMEM`): its page descriptors, and with `prefault`
    /// the whole frame arena. Checked before anything is touched, so the
    /// process is neither aborted nor killed by the host's OOM killer.
    #[error(
        "Vm::new: {what} need {need} bytes and the host can give {available} (MemAvailable + SwapFree, or the cgroup's limit); lower phys_bytes or turn prefault off"
    )]
    HostMemory {
        /// What needs the memory.
        what: &'static str,
        /// Bytes needed.
        need: u64,
        /// Bytes the host can give.
        available: u64,
    },
    /// An access a real process would die of with SIGBUS (`EFAULT` when a
    /// system call meets it): the page had to be read back from swap and
    /// the read failed. The page stays in swap; a later access reads it
    /// again.
    #[error("bus error at {addr:#x}: reading the page back from swap failed: {}", std::io::Error::from_raw_os_error(*errno))]
    PageIo {
        /// The faulting address.
        addr: u64,
        /// The host's errno.
        errno: i32,
    },
    /// Every vCPU slot is attached to a thread (`EBUSY`).
    #[error("Vm::attach: all {cpus} vCPU slots are attached (raise VmConfig::cpus)")]
    NoCpu {
        /// The configured number of vCPUs.
        cpus: usize,
    },
    /// The calling thread is already attached to this `Vm` (`EBUSY`).
    #[error("Vm::attach: this thread is already attached to this Vm as vCPU {cpu}")]
    AlreadyAttached {
        /// The slot the thread holds.
        cpu: usize,
    },
    /// A bad [`VmConfig`](crate::VmConfig) (`EINVAL`).
    #[error("VmConfig: {reason} ({value})")]
    Config {
        /// What was wrong.
        reason: &'static str,
        /// The offending value.
        value: u64,
    },
    /// A knob given by name that does not exist or does not parse
    /// ([`VmConfig::set`](crate::VmConfig::set); `EINVAL`).
    #[error("VmConfig::set({key}={value:?}): {reason}")]
    Knob {
        /// The knob's name.
        key: String,
        /// The value given.
        value: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// The host refused a system call vmfault needs (its errno is kept).
    #[error("host {call} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Host {
        /// The host call.
        call: &'static str,
        /// The host's errno.
        errno: i32,
    },
}

impl Error {
    /// The Linux errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::InvalidArgument { .. } | Error::Config { .. } | Error::Knob { .. } => libc::EINVAL,
            Error::NoMemory { .. }
            | Error::NotMapped { .. }
            | Error::NoAddressSpace { .. }
            | Error::TooManyMappings { .. }
            | Error::Unpopulated { .. }
            | Error::HostMemory { .. } => libc::ENOMEM,
            Error::TryAgain { .. } => libc::EAGAIN,
            Error::Exists { .. } => libc::EEXIST,
            Error::Permission { .. } => libc::EPERM,
            Error::Access { .. } => libc::EACCES,
            Error::NoDevice { .. } => libc::ENODEV,
            Error::BadFile { .. } | Error::BadDescriptor { .. } => libc::EBADF,
            Error::Overflow { .. } => libc::EOVERFLOW,
            Error::NotSupported { .. } => libc::EOPNOTSUPP,
            Error::Segv { .. } | Error::Bus { .. } | Error::PageIo { .. } | Error::OutsideMapping { .. } => {
                libc::EFAULT
            }
            Error::NoCpu { .. } | Error::AlreadyAttached { .. } | Error::Busy { .. } | Error::InUse { .. } => {
                libc::EBUSY
            }
            Error::Host { errno, .. } => *errno,
        }
    }

    pub(crate) fn inval(op: Op, reason: &'static str, value: u64) -> Error {
        Error::InvalidArgument { op, reason, value }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_matches_linux() {
        assert_eq!(Error::inval(Op::Mmap, "x", 1).errno(), 22);
        let nm = Error::NotMapped { op: Op::Mprotect, addr: 0, end: 4096 };
        assert_eq!(nm.errno(), 12);
        assert_eq!(Error::Exists { addr: 0, end: 1 }.errno(), 17);
        let segv = Error::Segv { addr: 5, code: SegvCode::AccErr };
        assert_eq!(segv.errno(), 14);
        assert_eq!(SegvCode::MapErr.si_code(), 1);
        assert_eq!(SegvCode::AccErr.si_code(), 2);
    }

    #[test]
    fn messages_name_op_and_value() {
        let e = Error::inval(Op::Mprotect, "address not page-aligned", 0x1234);
        assert_eq!(e.to_string(), "mprotect: address not page-aligned (0x1234)");
    }
}
