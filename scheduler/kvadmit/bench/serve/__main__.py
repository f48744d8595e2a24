"""`python -m kvadmit.bench.serve`: the same as `kvadmit bench serve`."""
import sys

from kvadmit.bench.serve.cli import main

sys.exit(main())
