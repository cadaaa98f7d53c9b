"""``python -m rgpu`` is the ``rgpu`` command."""
import sys

from .cli import main

sys.exit(main())
