from solution import chunks


def test_even():
    assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]
