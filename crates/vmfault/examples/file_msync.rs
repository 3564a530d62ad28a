//! A file mapped shared: stores through vmfault reach the file on `msync`,
//! as they would through `mmap(2)`; a private mapping of the same file
//! copies on write and never changes it.
//!
//! Run: `cargo run --release -p vmfault --example file_msync`

use std::io::Write;

use vmfault::{MapFlags, Prot, Vm, VmConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("vmfault-example-{}.dat", std::process::id()));
    std::fs::File::create(&path)?.write_all(&[b'.'; 8192])?;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;

    let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    let space = vm.new_space()?;
    let rw = Prot::READ | Prot::WRITE;
    let shared = space.mmap_file(0, 8192, rw, MapFlags::SHARED, &file, 0)?;
    let private = space.mmap_file(0, 8192, rw, MapFlags::PRIVATE, &file, 0)?;

    space.write(shared + 4096, b"written through a shared mapping")?;
    space.write(private, b"a private copy")?;
    space.msync(shared, 8192)?; // MS_SYNC: the dirty page is written back now

    let on_disk = std::fs::read(&path)?;
    assert_eq!(&on_disk[4096..4128], b"written through a shared mapping");
    assert_eq!(&on_disk[..14], b"..............", "private stores never reach the file");
    let mut seen = [0u8; 32];
    space.read(private + 4096, &mut seen)?;
    assert_eq!(&seen, b"written through a shared mapping", "an unwritten private page shows the file");
    for u in space.usage() {
        println!(
            "{:#x}..{:#x} shared={} rss={} anonymous={}",
            u.info.start, u.info.end, u.info.shared, u.rss, u.anonymous
        );
    }
    println!("the file holds the shared store after msync; the private copy stayed private");
    drop(space);
    std::fs::remove_file(&path)?;
    Ok(())
}
