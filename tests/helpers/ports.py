"""A free TCP port for tests that start ranks as processes (fairseq-train's, the spawned
gloo ranks of tests/distributed).

The ports are drawn below Linux's ephemeral range (32768-60999): gloo's own connections
take ephemeral ports, so a port picked there (as binding port 0 picks one) could be taken
by the time a later run binds it.  Each process draws from its own shuffled sequence
(seeded by its id), so parallel test workers do not try the same ports in the same order.
"""

import os
import random
import socket

_PORTS = iter(random.Random(os.getpid()).sample(range(20000, 32000), 2000))


def free_port() -> int:
    """A port in 20000-32000 that nothing listens on now."""
    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")
