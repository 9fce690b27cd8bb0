"""``python -m services.bench ...``: the same as ``hybrid-pd bench ...``."""

import sys

from services.bench.cli import main

sys.exit(main())
