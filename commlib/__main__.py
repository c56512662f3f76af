"""``python -m commlib [options] train.py ARGS...``: run an unmodified torch DDP script on
commlib (see :mod:`commlib.run`)."""
import sys

from .run import main

sys.exit(main())
