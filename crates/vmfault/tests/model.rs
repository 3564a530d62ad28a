//! Property test: random operation sequences against a reference model of
//! the address space (proptest state machine). Generation follows the
//! model, so loads, stores and protection changes aim at live memory more
//! often than chance would; every result is compared, and the whole
//! window's contents every few steps. At the end everything is unmapped
//! and every frame must be back.

mod common;

use common::model::Model;
use common::ops::*;
use common::{FAULT_PATHS, test_vm};
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use vmfault::{AddressSpace, Vm};

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = TOp;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<TOp> {
        let mapped = state.mapped_pages();
        if mapped.is_empty() {
            return op().boxed();
        }
        let pick = prop::sample::select(mapped);
        let targeted = prop_oneof![
            (pick.clone(), 0..P, 1..3 * P).prop_map(|(pg, at, len)| {
                let off = pg * P + at;
                TOp::Read { off, len: len.min(W - off) }
            }),
            (pick.clone(), 0..P, 1..3 * P, any::<u8>()).prop_map(|(pg, at, len, seed)| {
                let off = pg * P + at;
                TOp::Write { off, len: len.min(W - off), seed }
            }),
            (pick.clone(), 1..6u64, prop::sample::select(vec![0u32, 1, 3, 5]))
                .prop_map(|(pg, n, prot)| TOp::Mprotect { off: pg * P, len: (n * P).min(W - pg * P), prot }),
            (pick, 1..6u64).prop_map(|(pg, n)| TOp::Madvise {
                off: pg * P,
                len: (n * P).min(W - pg * P),
                advice: libc::MADV_DONTNEED
            }),
        ];
        prop_oneof![1 => op(), 1 => targeted].boxed()
    }

    fn apply(mut state: Model, op: &TOp) -> Model {
        state.apply(op);
        state
    }
}

/// One machine per fault path, all fed the same operations.
struct Sut {
    machines: Vec<(Vm, AddressSpace, u64)>,
    steps: u64,
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = Reference;

    fn init_test(_: &Model) -> Sut {
        let machines = FAULT_PATHS
            .iter()
            .map(|&path| {
                let vm = test_vm(4 << 20, 1, path);
                let space = vm.new_space().unwrap();
                let initial_free = vm.stats().free_pages;
                vmfault_guards(&space, VM_BASE);
                (vm, space, initial_free)
            })
            .collect();
        Sut { machines, steps: 0 }
    }

    fn apply(mut sut: Sut, model: &Model, op: TOp) -> Sut {
        for (vm, space, _) in &sut.machines {
            let got = run_vmfault(space, VM_BASE, &op, None);
            assert_eq!(Some(&got), model.last.as_ref(), "fault_path={}: {op:?}", vm.config().fault_path.name());
        }
        sut.steps += 1;
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        if !sut.steps.is_multiple_of(8) {
            return;
        }
        for (vm, space, _) in &sut.machines {
            for (page, bytes) in model.readable_pages() {
                let mut buf = vec![0u8; P as usize];
                space.read(VM_BASE + page * P, &mut buf).unwrap();
                let path = vm.config().fault_path.name();
                assert!(buf == bytes, "fault_path={path}: contents of window page {page} differ from the model");
            }
        }
    }

    fn teardown(sut: Sut, _: Model) {
        for (vm, space, initial_free) in &sut.machines {
            for m in space.mappings() {
                space.munmap(m.start, m.end - m.start).unwrap();
            }
            assert_eq!(
                common::settled_at(vm, *initial_free).free_pages,
                *initial_free,
                "fault_path={}: frames leaked",
                vm.config().fault_path.name()
            );
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn address_space_matches_reference_model(sequential 1..200 => Sut);
}
