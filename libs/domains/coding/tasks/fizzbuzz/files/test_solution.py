from solution import fizzbuzz


def test_three():
    assert fizzbuzz(3) == "Fizz"


def test_plain():
    assert fizzbuzz(1) == "1"
