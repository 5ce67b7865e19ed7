"""``python -m classgrad``: the same command line as the ``classgrad`` script."""

import sys

from classgrad.service.commands.cli import main

sys.exit(main())
