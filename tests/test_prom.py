"""Reading vLLM's Prometheus text."""

from hybrid_pd.common.prom import metric_label, metric_sum

TEXT = """# HELP vllm:num_requests_running Number of requests
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_running_total 9.0
vllm:cache_config_info{block_size="128",cache_dtype="auto"} 1.0
"""


def test_sum_over_label_sets_only_of_that_name():
    assert metric_sum(TEXT, "vllm:num_requests_running") == 3.0
    assert metric_sum(TEXT, "vllm:missing") == 0.0


def test_label_of_an_info_metric():
    assert metric_label(TEXT, "vllm:cache_config_info", "block_size") == "128"
    assert metric_label(TEXT, "vllm:cache_config_info", "nope") is None
