from solution import binary_search


def test_middle():
    assert binary_search([1, 3, 5, 7, 9], 5) == 2
