//! AFL++ entry point of the `wire_decode` target; the harness is `kernel_broker_fuzz::wire_decode`.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        kernel_broker_fuzz::wire_decode(data);
    });
}
