//! The stub's encoding, and the stubs run on the real kernel.
use super::*;

fn bytes(insns: &[Insn]) -> Vec<u8> {
    insns.iter().flatten().copied().collect()
}

/// The exact encoding, next to what LLVM emitted for the stub when it was an aya-ebpf
/// program (`call 0xc`, `r3 = 0x0`, `r0 = 0x0`, `exit`, and a map `ld_imm64` into r2).
#[test]
#[cfg(target_endian = "little")]
fn encodes_like_llvm() {
    let insns = program(0x1122_3344_5566_7788, 7);
    assert_eq!(insns.len(), 10);
    assert_eq!(
        bytes(&insns),
        [
            [0xb7, 0x02, 0, 0, 0x88, 0x77, 0x66, 0x55], // r2 = 0x55667788
            [0x63, 0x21, 48, 0, 0, 0, 0, 0],            // *(u32 *)(r1 + 48) = r2
            [0xb7, 0x02, 0, 0, 0x44, 0x33, 0x22, 0x11], // r2 = 0x11223344
            [0x63, 0x21, 52, 0, 0, 0, 0, 0],            // *(u32 *)(r1 + 52) = r2
            [0x18, 0x12, 0, 0, 7, 0, 0, 0],             // r2 = map fd 7 ll
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0xb7, 0x03, 0, 0, 0, 0, 0, 0], // r3 = 0
            [0x85, 0, 0, 0, 0x0c, 0, 0, 0], // call bpf_tail_call
            [0xb7, 0, 0, 0, 0, 0, 0, 0],    // r0 = TC_ACT_OK
            [0x95, 0, 0, 0, 0, 0, 0, 0],    // exit
        ]
        .concat()
    );
}

/// A cookie with the top bit of either half set still stores those exact 32 bits (the
/// sign extension of `mov` only touches the register's upper half).
#[test]
fn halves_are_the_cookie() {
    for cookie in [0, 1, u64::MAX, 0x8000_0000_8000_0000, 0x0000_0001_ffff_ffff] {
        let insns = program(cookie, 3);
        let imm = |i: &Insn| u32::from_ne_bytes([i[4], i[5], i[6], i[7]]);
        let low = u64::from(imm(&insns[0]));
        let high = u64::from(imm(&insns[2]));
        assert_eq!(low | (high << 32), cookie);
    }
}

/// On the real kernel: the stub hands the cookie to whatever slot 0 holds (here, programs
/// returning `cb[0]` or `cb[1]`), and passes the packet when the slot is empty.
#[test]
fn tail_calls_slot_0_with_the_cookie_in_cb() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test loads BPF programs into the kernel: run it as root"
    );
    let cookie = 0x8765_4321_0fed_cba9_u64;
    let slots = sys::testing::prog_array().expect("creating a program array");
    let stub = load(cookie, &slots).expect("loading the stub");
    assert_eq!(
        sys::testing::run(&stub).expect("running the stub"),
        0,
        "empty slot: TC_ACT_OK"
    );
    for (half, expected) in [(0, cookie & 0xffff_ffff), (1, cookie >> 32)] {
        // r0 = *(u32 *)(r1 + cb[half]); exit
        let reader = [
            insn(0x61, R0, R1, SKB_CB + 4 * half, 0),
            insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
        ];
        let reader = sys::prog_load_sched_cls("meshcap_test_cb", &reader, c"GPL").expect("reader");
        sys::testing::set(&slots, 0, &reader).expect("filling slot 0");
        assert_eq!(
            u64::from(sys::testing::run(&stub).expect("running the stub")),
            expected,
            "cb[{half}]"
        );
    }
}

/// On the real kernel: `lo`'s stub tail-calls slot 0 for a packet with ztunnel's mark
/// (0x539 under 0xfff, whatever the other bits) and passes every other one itself.
#[test]
fn lo_stub_tail_calls_for_ztunnel_marks_only() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test loads BPF programs into the kernel: run it as root"
    );
    let slots = sys::testing::prog_array().expect("creating a program array");
    let stub = load_lo(&slots).expect("loading the stub");
    // r0 = 7; exit
    let seven = [mov_imm(R0, 7), insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)];
    let seven = sys::prog_load_sched_cls("meshcap_test_7", &seven, c"GPL").expect("seven");
    sys::testing::set(&slots, 0, &seven).expect("filling slot 0");
    for (mark, expected) in [(0, 0), (0x539, 7), (0x1_0539, 7), (0x111, 0), (0x538, 0)] {
        assert_eq!(
            sys::testing::run_with_mark(&stub, mark).expect("running the stub"),
            expected,
            "mark {mark:#x}"
        );
    }
}

/// A refusal carries the verifier's reason.
#[test]
fn a_refusal_has_the_verifier_log() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test loads BPF programs into the kernel: run it as root"
    );
    // exit without setting r0.
    let bad = [insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)];
    let err = sys::prog_load_sched_cls("meshcap_test_bad", &bad, c"GPL")
        .expect_err("the verifier must refuse an unset r0");
    assert!(err.log.contains("R0 !read_ok"), "{err}");
}
