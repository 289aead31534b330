"""`python -m mpk`: the same as the `mpk` command."""

import sys

from mpk.cli import main

sys.exit(main())
