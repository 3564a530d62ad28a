//! A small guest routine run natively on guest memory: two vCPUs each sort
//! half of an array that lives in a vmfault address space, through a host
//! view, with the standard library's sort; then one merges the halves.
//! vmfault resolves every first touch of a page (the view's faults), the
//! rest runs at native speed, and the API reads back the same frames.
//!
//! Run: `cargo run --release -p vmfault --example native_sort`

use std::sync::Arc;

use vmfault::{MapFlags, Prot, Vm, VmConfig};

fn main() -> Result<(), vmfault::Error> {
    const N: usize = 1 << 20; // u32s: 4 MiB
    let vm = Vm::new(VmConfig { phys_bytes: 64 << 20, cpus: 2, host_views: true, ..VmConfig::default() })?;
    let space = vm.new_space()?;
    let bytes = (2 * N * 4) as u64; // the array and a buffer to merge into
    let a = space.mmap(0, bytes, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    let view = Arc::new(space.host_view(a, bytes)?);

    // Fill the array through the API (a guest loader would).
    let mut x = 0x2545_f491u32;
    let data: Vec<u8> = (0..N)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x.to_le_bytes()
        })
        .collect();
    space.write(a, &data)?;

    // Two vCPUs, each sorting its half natively.
    let halves: Vec<_> = (0..2)
        .map(|h| {
            let (vm, view) = (vm.clone(), view.clone());
            std::thread::spawn(move || -> Result<(), vmfault::Error> {
                let _cpu = vm.attach()?;
                let p = view.ptr(a + (h * N / 2 * 4) as u64)?.cast::<u32>();
                // SAFETY: the half lies inside the view; the other thread
                // works on the other half only.
                let half = unsafe { std::slice::from_raw_parts_mut(p, N / 2) };
                half.sort_unstable();
                Ok(())
            })
        })
        .collect();
    for h in halves {
        h.join().expect("a sorting vCPU panicked")?;
    }

    // Merge natively into the second buffer, on this thread.
    let _cpu = vm.attach()?;
    // SAFETY: both ranges lie inside the view and do not overlap.
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(view.ptr(a)?.cast::<u32>(), N),
            std::slice::from_raw_parts_mut(view.ptr(a + (N * 4) as u64)?.cast::<u32>(), N),
        )
    };
    let (mut i, mut j) = (0, N / 2);
    for out in dst.iter_mut() {
        *out = if j == N || (i < N / 2 && src[i] <= src[j]) {
            i += 1;
            src[i - 1]
        } else {
            j += 1;
            src[j - 1]
        };
    }

    // Check through the API: the same frames.
    let mut back = vec![0u8; N * 4];
    space.read(a + (N * 4) as u64, &mut back)?;
    let got: Vec<u32> = back.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    let mut want: Vec<u32> = data.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    want.sort_unstable();
    assert!(got == want, "the merged array is not sorted");
    let s = vm.stats();
    println!(
        "sorted {N} numbers on 2 vCPUs through a host view: {} pages faulted in by {} faults through the view",
        s.zero_fill, s.host_view_faults
    );
    Ok(())
}
