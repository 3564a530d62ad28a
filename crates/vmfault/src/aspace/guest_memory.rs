//! rust-vmm's guest-memory traits (cargo feature `vm-memory`): an
//! [`AddressSpace`] is `vm_memory::Bytes<GuestAddress>`, so virtio devices
//! and the other rust-vmm crates that take guest memory through `Bytes`
//! read and write vmfault memory, faulting pages in as the guest's own
//! loads and stores do.
//!
//! A guest address is an address of the space (a guest-virtual address,
//! or a guest-physical one where the embedder maps guest RAM 1:1 into
//! one space). How `Bytes` reads vmfault's answers:
//! - `read`/`write` move what they can: the bytes before the first address
//!   that faults (`SIGSEGV`, `SIGBUS`) and their count, or the error if it
//!   is the first byte; `read_slice`/`write_slice` need every byte
//!   (`PartialBuffer` otherwise, as rust-vmm's own memory says).
//! - `load`/`store` need a naturally aligned address (`InvalidBackendAddress`
//!   otherwise, as rust-vmm's memory refuses a misaligned atomic) and move
//!   the value in one single-copy-atomic access, ordered as vmfault orders
//!   every access (x86-like: see [`AddressSpace::read`]), whatever the
//!   `Ordering` asked for (never weaker).
//! - A fault is `InvalidGuestAddress` at the faulting address; anything
//!   else (a page that cannot be read back from swap) is an `IOError`
//!   carrying the errno vmfault's error has.
//!
//! ```
//! # #[cfg(feature = "vm-memory")] {
//! use vm_memory::{Bytes, GuestAddress};
//! use vmfault::{MapFlags, Prot, Vm, VmConfig};
//! let vm = Vm::new(VmConfig { phys_bytes: 8 << 20, ..VmConfig::default() }).unwrap();
//! let space = vm.new_space().unwrap();
//! let a = space.mmap(0, 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
//! space.write_obj(0x1234_5678u32, GuestAddress(a + 8)).unwrap();
//! assert_eq!(space.read_obj::<u32>(GuestAddress(a + 8)).unwrap(), 0x1234_5678);
//! space.store(7u16, GuestAddress(a + 2), std::sync::atomic::Ordering::Release).unwrap();
//! assert_eq!(space.load::<u16>(GuestAddress(a + 2), std::sync::atomic::Ordering::Acquire).unwrap(), 7);
//! # }
//! ```

use std::io::{Read, Write};
use std::sync::atomic::Ordering;

use vm_memory::{AtomicAccess, Bytes, GuestAddress, GuestMemoryError};

use super::AddressSpace;
use crate::error::Error;

/// rust-vmm's error for vmfault's: where it faulted, or the I/O error.
fn guest_error(e: Error) -> GuestMemoryError {
    match e {
        Error::Segv { addr, .. } | Error::Bus { addr, .. } => GuestMemoryError::InvalidGuestAddress(GuestAddress(addr)),
        e => GuestMemoryError::IOError(std::io::Error::from_raw_os_error(e.errno())),
    }
}

/// How many bytes an access that failed with `e` moved from `addr` on (the
/// bytes before its faulting address), if any.
fn moved(e: &Error, addr: u64) -> Option<usize> {
    let at = match e {
        Error::Segv { addr, .. } | Error::Bus { addr, .. } | Error::PageIo { addr, .. } => *addr,
        _ => return None,
    };
    usize::try_from(at.checked_sub(addr)?).ok().filter(|&n| n > 0)
}

/// The bytes of a value rust-vmm moves atomically, if it has a size an
/// aligned access of vmfault is single-copy atomic for.
fn atomic_size<T>(addr: u64) -> Result<usize, GuestMemoryError> {
    let n = std::mem::size_of::<T>();
    if !matches!(n, 1 | 2 | 4 | 8) || !addr.is_multiple_of(n as u64) {
        return Err(GuestMemoryError::InvalidBackendAddress);
    }
    Ok(n)
}

impl Bytes<GuestAddress> for AddressSpace {
    type E = GuestMemoryError;

    fn write(&self, buf: &[u8], addr: GuestAddress) -> Result<usize, Self::E> {
        match AddressSpace::write(self, addr.0, buf) {
            Ok(()) => Ok(buf.len()),
            Err(e) => moved(&e, addr.0).ok_or_else(|| guest_error(e)),
        }
    }

    fn read(&self, buf: &mut [u8], addr: GuestAddress) -> Result<usize, Self::E> {
        let len = buf.len();
        match AddressSpace::read(self, addr.0, buf) {
            Ok(()) => Ok(len),
            Err(e) => moved(&e, addr.0).ok_or_else(|| guest_error(e)),
        }
    }

    fn write_slice(&self, buf: &[u8], addr: GuestAddress) -> Result<(), Self::E> {
        AddressSpace::write(self, addr.0, buf).map_err(|e| match moved(&e, addr.0) {
            Some(completed) => GuestMemoryError::PartialBuffer { expected: buf.len(), completed },
            None => guest_error(e),
        })
    }

    fn read_slice(&self, buf: &mut [u8], addr: GuestAddress) -> Result<(), Self::E> {
        let expected = buf.len();
        AddressSpace::read(self, addr.0, buf).map_err(|e| match moved(&e, addr.0) {
            Some(completed) => GuestMemoryError::PartialBuffer { expected, completed },
            None => guest_error(e),
        })
    }

    fn read_from<F: Read>(&self, addr: GuestAddress, src: &mut F, count: usize) -> Result<usize, Self::E> {
        let mut buf = vec![0u8; count];
        let n = src.read(&mut buf).map_err(GuestMemoryError::IOError)?;
        Bytes::write(self, &buf[..n], addr)
    }

    fn read_exact_from<F: Read>(&self, addr: GuestAddress, src: &mut F, count: usize) -> Result<(), Self::E> {
        let mut buf = vec![0u8; count];
        src.read_exact(&mut buf).map_err(GuestMemoryError::IOError)?;
        self.write_slice(&buf, addr)
    }

    fn write_to<F: Write>(&self, addr: GuestAddress, dst: &mut F, count: usize) -> Result<usize, Self::E> {
        let mut buf = vec![0u8; count];
        let n = Bytes::read(self, &mut buf, addr)?;
        dst.write(&buf[..n]).map_err(GuestMemoryError::IOError)
    }

    fn write_all_to<F: Write>(&self, addr: GuestAddress, dst: &mut F, count: usize) -> Result<(), Self::E> {
        let mut buf = vec![0u8; count];
        self.read_slice(&mut buf, addr)?;
        dst.write_all(&buf).map_err(GuestMemoryError::IOError)
    }

    fn store<T: AtomicAccess>(&self, val: T, addr: GuestAddress, _order: Ordering) -> Result<(), Self::E> {
        atomic_size::<T>(addr.0)?;
        // An aligned store of at most a word is one word store (or one
        // compare-and-swap of the word around it), and every access is
        // fenced (sequentially consistent on the host).
        self.write_slice(val.as_slice(), addr)
    }

    fn load<T: AtomicAccess>(&self, addr: GuestAddress, _order: Ordering) -> Result<T, Self::E> {
        atomic_size::<T>(addr.0)?;
        // An aligned load of at most a word is one word load.
        self.read_obj(addr)
    }
}
