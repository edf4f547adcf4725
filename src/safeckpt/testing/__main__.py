"""``python -m safeckpt.testing BACKING MOUNTPOINT --config JSON``: serve the NFS test filesystem."""

import sys

from .nfsfs import main

sys.exit(main())
