//! Memory over-committed four times: a machine of 8 MiB with a swap file
//! writes 32 MiB and reads every page back in random order. The page
//! daemon pages out what has not been used lately; faults read pages back.
//!
//! Run: `cargo run --release -p vmfault --example swap_overcommit`

use vmfault::{MapFlags, Prot, Vm, VmConfig};

fn main() -> Result<(), vmfault::Error> {
    let swap = std::env::temp_dir().join(format!("vmfault-example-{}.swap", std::process::id()));
    let vm = Vm::new(VmConfig {
        phys_bytes: 8 << 20,
        cpus: 1,
        swap: Some(swap),
        swap_bytes: 64 << 20,
        ..VmConfig::default()
    })?;
    let _cpu = vm.attach()?;
    let space = vm.new_space()?;
    const PAGES: u64 = 8192; // 32 MiB
    let a = space.mmap(0, PAGES * 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    let stamp = |p: u64| (p.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes();
    for p in 0..PAGES {
        space.write(a + p * 4096, &stamp(p))?;
    }
    // Every page back, in a scrambled order.
    let mut w = [0u8; 8];
    for i in 0..PAGES {
        let p = (i * 5_573) % PAGES;
        space.read(a + p * 4096, &mut w)?;
        assert_eq!(w, stamp(p), "page {p} came back wrong");
    }
    let s = vm.stats();
    let u = &space.usage()[0];
    println!(
        "32 MiB on an 8 MiB machine: {} pageouts, {} page-ins, now {} KiB resident and {} KiB in swap; nothing lost",
        s.pageouts,
        s.pageins,
        u.rss >> 10,
        u.swap >> 10
    );
    assert!(s.pageouts > 0);
    Ok(())
}
