"""``python -m hybrid_pd.bench ...``: the same as ``hybrid-pd bench ...``."""

import sys

from hybrid_pd.bench.cli import main

sys.exit(main())
