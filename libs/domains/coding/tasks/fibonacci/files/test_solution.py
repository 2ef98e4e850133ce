from solution import fib


def test_small():
    assert [fib(i) for i in range(6)] == [0, 1, 1, 2, 3, 5]
