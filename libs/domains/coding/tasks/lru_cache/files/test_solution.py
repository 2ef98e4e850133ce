from solution import LRUCache


def test_get_put():
    cache = LRUCache(2)
    cache.put(1, "a")
    assert cache.get(1) == "a"
    assert cache.get(2) == -1
