"""``python -m cli`` is the ``eagle3`` command."""

import sys

from cli.main import main

sys.exit(main())
