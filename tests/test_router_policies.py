"""Selection policies, request info, the worker registry's pool rules and the compatibility filter."""

from collections import Counter

import pytest

from hybrid_pd.connector.compat import IncompatibleWorkers, WorkerIdentity
from hybrid_pd.router.pairing import compatible_prefills
from hybrid_pd.router.policies import LeastOutstanding, PolicyContext, PowerOfTwo, PrefixAffinity, RequestInfo, RoundRobin, make_policy
from hybrid_pd.router.prefix_index import CHARS_PER_TOKEN, GRAIN_TOKENS, SentPrefixes, prefix_chain, reusable_tokens
from hybrid_pd.router.registry import Registry, Worker


def _w(url, role="decode", inflight=0, tokens=0, **identity):
    """An admitted worker (it has passed a health check)."""
    w = Worker(url=url, role=role, identity=WorkerIdentity(role=role, model="m", **identity), healthy=True)
    w.inflight, w.inflight_tokens = inflight, tokens
    return w


INFO = RequestInfo(affinity_key="k", est_tokens=10)


def test_round_robin_takes_each_in_turn():
    workers = [_w("http://b"), _w("http://a"), _w("http://c")]
    policy = RoundRobin()
    assert [policy.choose(workers, INFO).url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]


def test_least_outstanding_by_requests_then_tokens():
    workers = [_w("http://a", inflight=2), _w("http://b", inflight=1, tokens=900), _w("http://c", inflight=1, tokens=5)]
    assert LeastOutstanding().choose(workers, INFO).url == "http://c"


def test_power_of_two_never_picks_the_busiest_of_three():
    workers = [_w("http://a", inflight=0), _w("http://b", inflight=5), _w("http://c", inflight=9)]
    policy = PowerOfTwo(seed=1)
    picks = Counter(policy.choose(workers, INFO).url for _ in range(300))
    assert picks["http://c"] == 0 and picks["http://a"] > picks["http://b"] > 0


def test_prefix_affinity_is_sticky_and_moves_only_the_lost_workers_keys():
    workers = [_w(f"http://w{i}") for i in range(4)]
    policy = PrefixAffinity()
    keys = [RequestInfo(affinity_key=f"user-{i}", est_tokens=1) for i in range(400)]
    before = {k.affinity_key: policy.choose(workers, k).url for k in keys}
    assert before == {k.affinity_key: policy.choose(workers, k).url for k in keys}
    assert min(Counter(before.values()).values()) > 40, "keys spread over every worker"
    after = {k.affinity_key: policy.choose(workers[:3], k).url for k in keys}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "http://w3" for k in moved)


def test_request_info_key_and_size():
    assert RequestInfo.from_body({"prompt": "x" * 400, "user": "alice"}).affinity_key == "alice"
    assert RequestInfo.from_body({"prompt": "abcd" * 100}).est_tokens == 100
    assert RequestInfo.from_body({"prompt": [1, 2, 3]}).est_tokens == 3
    chat = RequestInfo.from_body({"messages": [{"role": "user", "content": "hello world!"}]})
    assert chat.affinity_key == "hello world!" and chat.est_tokens == 3


def test_request_info_key_is_cut_from_the_prompt_when_read_and_a_user_key_is_whole():
    ids = RequestInfo.from_body({"prompt": list(range(300))}, prefix_chars=10)
    assert ids.affinity_key == "0 1 2 3 4 " and ids.est_tokens == 300
    assert RequestInfo.from_body({"prompt": "abcdefghijkl"}, prefix_chars=5).affinity_key == "abcde"
    assert RequestInfo.from_body({"prompt": [1, 2], "user": "u" * 20}, prefix_chars=5).affinity_key == "u" * 20
    assert RequestInfo.from_body({"prompt": [1, "a"]}).est_tokens == len(str([1, "a"])) // 4, "a mixed list is text"


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="least_outstanding"):
        make_policy("fastest")


def test_registry_refuses_a_worker_that_fits_no_peer_and_names_the_field():
    registry = Registry()
    registry.add(_w("http://d", role="decode", block_size=128))
    with pytest.raises(IncompatibleWorkers, match="block_size"):
        registry.add(_w("http://p", role="prefill", block_size=64))
    registry.add(_w("http://p", role="prefill", block_size=128))
    assert [w.url for w in registry.role("prefill")] == ["http://p"]


def test_compatible_prefills_follow_tp_divisibility():
    registry = Registry()
    decode = registry.add(_w("http://d", role="decode", tensor_parallel_size=2))
    registry.add(_w("http://p1", role="prefill", tensor_parallel_size=1))
    registry.add(_w("http://p4", role="prefill", tensor_parallel_size=4))
    registry.add(_w("http://p3", role="prefill"))  # unknown TP is not guessed
    assert {w.url for w in compatible_prefills(registry, decode)} == {"http://p1", "http://p4", "http://p3"}
    assert registry.get(decode.id) is decode


def test_role_lists_follow_every_registration_replacement_removal_and_expiry():
    registry = Registry(heartbeat_ttl_s=10)
    assert registry.role("decode") == ()
    first = registry.add(_w("http://d1"))
    assert [w is first for w in registry.role("decode")] == [True]
    prefill = registry.add(_w("http://p", role="prefill"))
    assert registry.role("prefill")[0] is prefill and len(registry.role("decode")) == 1
    again = registry.add(_w("http://d1"))  # registers again: replaces its entry
    assert [w is again for w in registry.role("decode")] == [True]
    second = registry.add(_w("http://d2"))
    assert [w.url for w in registry.role("decode")] == ["http://d1", "http://d2"]
    registry.remove(again.id)
    assert [w is second for w in registry.role("decode")] == [True]
    registry.expire(now=second.last_seen + 11)
    assert registry.role("decode") == () and registry.role("prefill") == ()


def test_availability_and_pairing_are_read_live_whatever_changed_them():
    registry = Registry(eviction_failures=1)
    decode = registry.add(_w("http://d"))
    prefill = registry.add(_w("http://p", role="prefill"))
    assert compatible_prefills(registry, decode) == [prefill]
    registry.record_health(prefill, ok=False)  # evicted
    assert compatible_prefills(registry, decode) == []
    registry.record_health(prefill, ok=True)  # re-admitted
    assert compatible_prefills(registry, decode) == [prefill]
    prefill.draining = True  # the admin API drains a worker in place
    assert compatible_prefills(registry, decode) == []
    prefill.draining = False
    prefill.identity = WorkerIdentity(role="prefill", model="another")  # what the health loop learned
    assert compatible_prefills(registry, decode) == []


def test_eviction_after_consecutive_failures_and_readmission():
    registry = Registry(eviction_failures=3)
    w = registry.add(_w("http://d"))
    for _ in range(2):
        registry.record_health(w, ok=False)
    assert w.available
    registry.record_health(w, ok=False)
    assert not w.available and registry.evictions == 1
    registry.record_health(w, ok=True)
    assert w.available and w.failures == 0


def test_a_new_worker_is_unknown_until_its_first_passing_check_and_a_heartbeat_does_not_admit_it():
    registry = Registry(eviction_failures=1)
    w = registry.add(Worker(url="http://d", role="decode", identity=WorkerIdentity(role="decode", model="m")))
    assert not w.available and w.view()["state"] == "unknown"
    registry.record_health(w, ok=False)  # still starting: not an eviction
    registry.touch(w)  # the worker service heartbeats while its vLLM hangs
    assert not w.available and w.view()["state"] == "unknown" and registry.evictions == 0
    registry.record_health(w, ok=True)
    assert w.available and w.view()["state"] == "healthy"
    registry.record_health(w, ok=False)
    registry.touch(w)
    assert not w.available and w.view()["state"] == "evicted" and registry.evictions == 1


def test_dynamic_workers_expire_without_heartbeats_static_ones_stay():
    registry = Registry(heartbeat_ttl_s=10)
    dynamic = registry.add(_w("http://dyn"))
    static = registry.add(_w("http://static"))
    static.static = True
    assert registry.expire(now=dynamic.last_seen + 11) == [dynamic]
    assert registry.all() == [static]


def test_registering_again_keeps_the_id():
    registry = Registry()
    first = registry.add(_w("http://d"))
    again = registry.add(_w("http://d"))
    assert again.id == first.id and len(registry.all()) == 1


def test_request_info_never_fails_on_malformed_fields():
    """Found by the e2e fuzz run: ``{"messages": true}`` was a 500; vLLM must get to say 400."""
    for body in ({"messages": True}, {"messages": "hi"}, {"prompt": None}, {"messages": [1, None]}):
        RequestInfo.from_body(body)


# prefix_reuse (hybrid_pd/router/prefix_index.py): what a worker can resume is the prefix it was sent,
# rounded down to the granule where its vLLM's prefix-cache hits land (a hybrid's state checkpoint block).
def _ids(n, start=0):
    return list(range(start, start + n))


def _reuse(**context):
    reported = []
    policy = make_policy("prefix_reuse", PolicyContext(report=lambda outcome, tokens: reported.append((outcome, tokens)), **context))
    return policy, reported


def test_prefix_chain_grains_stand_for_the_whole_prefix():
    a, b = prefix_chain(_ids(100)), prefix_chain(_ids(100)[:50] + _ids(50, 1000))
    assert len(a) == 100 // GRAIN_TOKENS and a[:3] == b[:3] and a[3] != b[3]  # part at grain 4 (tokens 48-63)
    assert prefix_chain([1, 2, 3]) == []  # shorter than a grain
    text = "x" * (GRAIN_TOKENS * CHARS_PER_TOKEN * 2)
    assert len(prefix_chain(text)) == 2 and prefix_chain(text)[1] != prefix_chain("y" + text[1:])[1]


def test_reusable_is_the_match_rounded_down_to_the_checkpoint_and_short_of_the_prompt():
    assert reusable_tokens(matched_grains=20, prompt_tokens=1000, granule=128) == 256  # 320 matched -> 2 blocks
    assert reusable_tokens(20, 1000, None) == 0  # prefix caching off there
    assert reusable_tokens(7, 1000, 128) == 0  # 112 matched attention tokens, no checkpoint: nothing
    assert reusable_tokens(16, 256, 128) == 128  # the whole prompt matched: vLLM computes its last token


def test_sent_prefixes_forget_the_oldest_beyond_capacity():
    sent = SentPrefixes()
    first, second = prefix_chain(_ids(64)), prefix_chain(_ids(64, 500))
    sent.record(first, capacity_tokens=64)
    assert sent.matched_grains(first) == 4
    sent.record(second, capacity_tokens=64)
    assert sent.matched_grains(first) == 0 and sent.matched_grains(second) == 4


def test_prefix_reuse_sends_each_turn_where_its_conversation_can_resume():
    workers = [_w("http://a", prefix_hit_tokens=128), _w("http://b", prefix_hit_tokens=128)]
    policy, reported = _reuse()
    system = _ids(300, 7)
    turn = lambda n: RequestInfo(len(system) + n, prompt=system + _ids(n, 2000))  # noqa: E731
    first = policy.choose(workers, turn(40))
    workers[0 if first is workers[1] else 1].inflight = 1  # the other one looks less busy now
    assert policy.choose(workers, turn(100)) is first
    assert reported == [("miss", 0), ("hit", 256)]


def test_prefix_reuse_ignores_matches_without_a_checkpoint_and_workers_without_caching():
    cached, uncached = _w("http://a", prefix_hit_tokens=128), _w("http://b", inflight=1)
    policy, reported = _reuse()
    prompt = _ids(500)
    policy.choose([uncached], RequestInfo(500, prompt=prompt))  # b saw it, but caches nothing
    assert policy.choose([cached, uncached], RequestInfo(500, prompt=prompt)) is cached  # least loaded: a miss
    cached.inflight = 2
    short = _ids(100)  # a prefix of the prompt a holds, shorter than one checkpoint block
    assert policy.choose([cached, uncached], RequestInfo(100, prompt=short)) is uncached
    assert [outcome for outcome, _ in reported] == ["miss", "miss", "miss"]


def test_prefix_reuse_gives_way_to_load_beyond_the_slack():
    holder, idle = _w("http://a", prefix_hit_tokens=128), _w("http://b", prefix_hit_tokens=128)
    policy, reported = _reuse(load_slack=2)
    prompt = _ids(600)
    policy.choose([holder], RequestInfo(600, prompt=prompt))
    holder.inflight = 2
    assert policy.choose([holder, idle], RequestInfo(600, prompt=prompt)) is holder  # within the slack
    holder.inflight = 3
    assert policy.choose([holder, idle], RequestInfo(600, prompt=prompt)) is idle
    assert reported[1:] == [("hit", 512), ("balanced", 0)]
    idle.inflight = 9  # now both hold it: the less busy one, a hit either way
    assert policy.choose([holder, idle], RequestInfo(600, prompt=prompt)) is holder and reported[-1] == ("hit", 512)
