"""``python -m services.eval gsm8k ...``: the same as ``hybrid-pd eval gsm8k ...``."""

import sys

from services.eval.cli import main

sys.exit(main())
