from solution import primes_up_to


def test_ten():
    assert primes_up_to(10) == [2, 3, 5, 7]
