"""`python -m kvadmit.vllm.bench`: the same as `kvadmit bench vllm`."""
import sys

from kvadmit.vllm.bench.cli import main

sys.exit(main())
