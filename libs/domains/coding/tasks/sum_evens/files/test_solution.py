from solution import sum_evens


def test_mixed():
    assert sum_evens([1, 2, 3, 4]) == 6
