//! AFL++ entry point of the `stream_frame` target; the harness is `kernel_broker_fuzz::stream_frame`.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        kernel_broker_fuzz::stream_frame(data);
    });
}
