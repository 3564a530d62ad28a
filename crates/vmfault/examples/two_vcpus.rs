//! A guest on two vCPUs, the way an emulator embeds vmfault: one address
//! space, two threads attached as vCPUs, a spinlock and a counter built
//! from guest atomics (`compare_exchange`, `fetch_add`), then a `fork`
//! whose child sees the parent's memory as it was and copies on write.
//!
//! Run: `cargo run --release -p vmfault --example two_vcpus`

use vmfault::{MapFlags, Prot, Vm, VmConfig};

fn main() -> Result<(), vmfault::Error> {
    let vm = Vm::new(VmConfig { phys_bytes: 32 << 20, cpus: 2, ..VmConfig::default() })?;
    let space = vm.new_space()?;
    let page = space.mmap(0, 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    let (lock, counter, log) = (page, page + 8, page + 64);
    const ROUNDS: u64 = 10_000;

    std::thread::scope(|s| {
        for cpu in 0..2u64 {
            let (vm, space) = (&vm, &space);
            s.spawn(move || -> Result<(), vmfault::Error> {
                let _cpu = vm.attach()?; // this thread is a vCPU until the guard drops
                for i in 0..ROUNDS {
                    // A counter: `lock xadd`.
                    space.fetch_add_u64(counter, 1)?;
                    // A spinlock around a read-modify-write of two words:
                    // `lock cmpxchg` to take it, a store to release it.
                    while space.compare_exchange_u32(lock, 0, 1)?.is_err() {
                        std::hint::spin_loop();
                    }
                    let mut w = [0u8; 16];
                    space.read(log, &mut w)?;
                    let (n, last) = (u64::from_le_bytes(w[..8].try_into().unwrap()), cpu * ROUNDS + i);
                    w[..8].copy_from_slice(&(n + 1).to_le_bytes());
                    w[8..].copy_from_slice(&last.to_le_bytes());
                    space.write(log, &w)?;
                    space.swap_u32(lock, 0)?;
                }
                Ok(())
            });
        }
    });

    let mut w = [0u8; 8];
    space.read(counter, &mut w)?;
    let count = u64::from_le_bytes(w);
    space.read(log, &mut w)?;
    let locked = u64::from_le_bytes(w);
    println!("two vCPUs: counter {count}, lock-protected count {locked} (each should be {})", 2 * ROUNDS);
    assert_eq!((count, locked), (2 * ROUNDS, 2 * ROUNDS));

    // fork: the child starts with the parent's memory, copy-on-write.
    let child = space.fork()?;
    child.write(counter, &0u64.to_le_bytes())?;
    space.read(counter, &mut w)?;
    assert_eq!(u64::from_le_bytes(w), 2 * ROUNDS, "the parent keeps its own page");
    child.read(log, &mut w)?;
    assert_eq!(u64::from_le_bytes(w), 2 * ROUNDS, "the child saw the parent's memory");
    println!("fork: the child reset its counter, the parent's is still {}", 2 * ROUNDS);
    println!("{} faults in the parent's space, {} in the child's", space.faults(), child.faults());
    Ok(())
}
