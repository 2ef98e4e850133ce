from solution import rotate


def test_one():
    assert rotate([1, 2, 3], 1) == [3, 1, 2]
