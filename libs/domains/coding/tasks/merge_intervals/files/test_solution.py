from solution import merge_intervals


def test_overlap():
    assert merge_intervals([[1, 3], [2, 6]]) == [[1, 6]]
