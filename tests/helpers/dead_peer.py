"""Two ranks started by hand (tests/ranks/test_dead_peer.py): rank 1 dies by SIGKILL right after init();
rank 0 times its phalanx.shutdown(), which must notice the dead peer instead of waiting out its bound."""

import os
import signal
import time

import phalanx


def main() -> None:
    phalanx.init()
    if phalanx.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    started = time.monotonic()
    phalanx.shutdown()
    print(f"SHUTDOWN took {time.monotonic() - started:.2f}s", flush=True)


if __name__ == "__main__":
    main()
