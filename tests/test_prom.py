"""Reading vLLM's Prometheus text."""

from hybrid_pd.common.prom import cache_block_size, histogram_mean, metric_label, metric_sum, prefix_hit_tokens

TEXT = """# HELP vllm:num_requests_running Number of requests
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_running_total 9.0
vllm:cache_config_info{block_size="128",cache_dtype="auto"} 1.0
"""


def test_sum_over_label_sets_only_of_that_name():
    assert metric_sum(TEXT, "vllm:num_requests_running") == 3.0
    assert metric_sum(TEXT, "vllm:missing") == 0.0


def test_histogram_mean_between_two_scrapes_over_label_sets_and_none_without_observations():
    def scrape(total: float, count: int) -> str:
        return (f'vllm:ttft_seconds_sum{{engine="0"}} {total / 2}\nvllm:ttft_seconds_sum{{engine="1"}} {total / 2}\n'
                f'vllm:ttft_seconds_count{{engine="0"}} {count}\nvllm:ttft_seconds_bucket{{le="1.0"}} {count}\n')

    assert histogram_mean(scrape(1.0, 4), scrape(4.0, 10), "vllm:ttft_seconds") == (0.5, 6)
    assert histogram_mean(scrape(1.0, 4), scrape(1.0, 4), "vllm:ttft_seconds") is None


def test_label_of_an_info_metric():
    assert metric_label(TEXT, "vllm:cache_config_info", "block_size") == "128"
    assert metric_label(TEXT, "vllm:cache_config_info", "nope") is None


def _info(**labels: str) -> str:
    return "vllm:cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} 1.0\n"


def test_prefix_hit_granule_is_none_without_prefix_caching_and_the_checkpoint_block_with_it():
    assert prefix_hit_tokens(_info(block_size="2048", enable_prefix_caching="False", mamba_block_size="None")) is None
    assert prefix_hit_tokens(_info(block_size="128", enable_prefix_caching="True", mamba_block_size="None")) == 128
    on = _info(block_size="2048", enable_prefix_caching="True", mamba_block_size="1040", cache_hit_alignment_tokens="None")
    assert prefix_hit_tokens(on) == 1040 and cache_block_size(on) == 2048
    assert prefix_hit_tokens(_info(block_size="2048", enable_prefix_caching="True", cache_hit_alignment_tokens="520", mamba_block_size="1040")) == 520
    assert prefix_hit_tokens("") is None and cache_block_size("") is None


def test_the_block_the_engine_logged_comes_before_the_api_servers_labels():
    on = _info(block_size="16", enable_prefix_caching="True", mamba_block_size="None")
    assert prefix_hit_tokens(on) == 16 and prefix_hit_tokens(on, engine_block=1152) == 1152
    assert prefix_hit_tokens(_info(block_size="16", enable_prefix_caching="False"), engine_block=1152) is None
    assert prefix_hit_tokens(_info(block_size="16", enable_prefix_caching="True", effective_attention_block_size="128")) == 128
