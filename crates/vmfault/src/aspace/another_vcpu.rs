//! Tests' helper: another vCPU that holds something (a read-side section,
//! a map lock) while the test does what it checks.

use std::sync::mpsc;

use crate::machine::{Ctx, Vm};

/// Run `f` while another vCPU of `vm` holds what `hold` takes: `hold`
/// takes it in that vCPU's context, then calls the `wait` it is given,
/// which returns once `f` is done.
pub(super) fn while_another_vcpu_holds<R>(
    vm: &Vm,
    hold: impl FnOnce(&Ctx<'_>, &dyn Fn()) + Send,
    f: impl FnOnce() -> R,
) -> R {
    let (inside_tx, inside_rx) = mpsc::channel();
    let (leave_tx, leave_rx) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let other = vm.clone();
        let t = scope.spawn(move || {
            let _cpu = other.attach().unwrap();
            other.with_ctx(|ctx| {
                hold(ctx, &|| {
                    inside_tx.send(()).unwrap();
                    let _ = leave_rx.recv();
                });
            });
        });
        inside_rx.recv().unwrap();
        let r = f();
        drop(leave_tx);
        t.join().unwrap();
        r
    })
}
