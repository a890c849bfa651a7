import pytest

from engines.prefix_cache import PrefixCodeCache, prefix_digest, prefix_key


def test_lru_eviction_respects_the_byte_budget():
    c = PrefixCodeCache(budget_bytes=10)
    c.put("a", b"1234")
    c.put("b", b"5678")
    assert c.get("a") == b"1234"                  # a is now most recent
    c.put("c", b"9999")                           # 12 bytes > 10: evict least recent (b)
    assert c.get("b") is None and c.get("a") == b"1234" and c.get("c") == b"9999"
    assert c.stats.bytes == 8 and c.stats.evictions == 1 and c.stats.entries == 2
    c.put("huge", b"x" * 11)                      # larger than the whole budget: not cached, nothing evicted
    assert c.get("huge") is None and c.stats.entries == 2


def test_keys_separate_prefixes_pairs_and_versions():
    k = prefix_key([1, 2, 3], "base:qa", "v1")
    assert k != prefix_key([1, 2, 4], "base:qa", "v1")
    assert k != prefix_key([1, 2, 3], "base:prose", "v1")
    assert k != prefix_key([1, 2, 3], "base:qa", "v2")
    assert prefix_key([12, 3], "p:c", "v") != prefix_key([1, 23], "p:c", "v")
    assert prefix_key([1, 2], "p:c", "v") != prefix_key([1, 2, 0], "p:c", "v"), "a trailing 0 is a token too"
    ids = [5, 151_000, 2**40]
    assert prefix_key(ids, "p:c", "v", prefix_digest(ids)) == prefix_key(ids, "p:c", "v"), "a digest given is the same"


def test_negative_budget_is_refused():
    with pytest.raises(ValueError):
        PrefixCodeCache(-1)
