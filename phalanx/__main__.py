"""`python -m phalanx ...` is the `phalanx` command."""

import sys

from .cli import main

sys.exit(main())
