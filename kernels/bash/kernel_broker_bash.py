"""The bash kernel (bash_kernel, from PyPI), started without pexpect's pause before each write.

pexpect sleeps 50 ms before every write to the terminal it drives (``delaybeforesend``, a
guard for old terminals that dropped input sent too early). bash_kernel writes a few lines
to set its prompt at start and one per cell, so its start took 2.7 s and each cell 100 ms
more than bash itself. bash on a pseudo-terminal takes input written at once, so the kernel
here is bash_kernel's own, its pexpect sessions made without that pause: a start of about
0.5 s and a cell's round trip of a few milliseconds.

Run as ``python -I kernel_broker_bash.py -f CONNECTION_FILE`` (``kernels/bash/kernel.json``).
"""

import pexpect

_spawn_init = pexpect.spawn.__init__


def _spawn_without_delay(self, *args, **kwargs):
    _spawn_init(self, *args, **kwargs)
    self.delaybeforesend = None


pexpect.spawn.__init__ = _spawn_without_delay

from bash_kernel.kernel import BashKernel  # noqa: E402 (after the patch, which it uses)
from ipykernel.kernelapp import IPKernelApp  # noqa: E402

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel)
