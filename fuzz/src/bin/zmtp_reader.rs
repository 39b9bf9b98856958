//! AFL++ entry point of the `zmtp_reader` target; the harness is `kernel_broker_fuzz::zmtp_reader`.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        kernel_broker_fuzz::zmtp_reader(data);
    });
}
