"""`python -m phalanx.allocator`: print the LD_PRELOAD that starts ranks with phalanx's allocator."""

import sys

from . import main

sys.exit(main())
