//! AFL++ entry point of the `jupyter_framing` target; the harness is `kernel_broker_fuzz::jupyter_framing`.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        kernel_broker_fuzz::jupyter_framing(data);
    });
}
