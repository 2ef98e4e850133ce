def fizzbuzz(n):
    """Return the FizzBuzz word for n (n >= 1)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
