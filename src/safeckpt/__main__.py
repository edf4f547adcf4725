"""``python -m safeckpt``: the ``safeckpt`` command."""

import sys

from .cli import main

sys.exit(main())
