"""`python -m kvadmit.bench.vllm`: the same as `kvadmit bench vllm`."""
import sys

from kvadmit.bench.vllm.cli import main

sys.exit(main())
