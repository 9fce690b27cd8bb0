"""``python -m hybrid_pd.eval gsm8k ...``: the same as ``hybrid-pd eval gsm8k ...``."""

import sys

from hybrid_pd.eval.cli import main

sys.exit(main())
